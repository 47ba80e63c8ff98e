"""Model runner: owns the model, the paged KV tensors and per-request runner state; turns a
SchedulerOutput into sampled tokens (forward -> logits -> sample)."""
from __future__ import annotations

import time
from typing import Optional

import torch

from tokenmill.layers import cpu_ops
from tokenmill.layers.attention import get_attention_backend
from tokenmill.runner import fused_stack
from tokenmill.outputs import Logprob, ModelRunnerOutput
from tokenmill.runner.faults import FaultInjector
from tokenmill.runner.input_builder import ModelInput, RunnerRequestState, build_model_input
from tokenmill.kv.layout import KVLayout
from tokenmill.runner.kv_tensors import allocate_kv_caches, move_kv_positions
from tokenmill.runner.pooler import pool_rows
from tokenmill.sample.grammar_mask import bitmask_rows
from tokenmill.sample.metadata import (RowSamplingState, build_sampling_metadata, make_request_generator,
                                       step_seed)
from tokenmill.sample.noise_budget import NoiseBudget
from tokenmill.sample.rejection import RejectionSampler
from tokenmill.sample.sampler import Sampler, compute_logprobs, position_noise, torch_argmax
from tokenmill.sched.output import SchedulerOutput
from tokenmill.spec.coupled import coupled
from tokenmill.spec.draft_input import AuxCapture, StepFeatures


def compile_layers(model: torch.nn.Module, backend) -> None:
    """torch.compile every decoder layer in place (shapes dynamic: one graph serves every
    token count of a shape class). The attention backend stays eager (its paged-cache
    bookkeeping is Python); the fused CPU kernels step aside while tracing
    (cpu_ops.tracing), so inductor fuses the norm / RoPE / SiLU ops itself. Layers run by
    the one-call decode stack (runner/fused_stack.py) are not affected."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"torch_compile: {type(model).__name__} has no model.layers to compile")
    backend.forward = torch.compiler.disable(backend.forward)
    for layer in layers:
        layer.compile(dynamic=True)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_layout: KVLayout, block_size: int,
                 device: torch.device, dtype: torch.dtype, attention_backend: str = "auto",
                 seed: int = 0, torch_compile: bool = False, cpu_kernels: bool = True,
                 faults: Optional[FaultInjector] = None, cuda_graphs: bool = False,
                 max_num_seqs: int = 64, max_model_len: int = 2048,
                 bf16_prefill: bool = False, huge_pages: bool = False) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        a = model.args
        self.vocab_size = a.vocab_size
        # a tensor-parallel rank's cache holds only its KV heads; each KV group's layers have
        # as many blocks as its pool
        self.kv_layout = kv_layout
        self.kv_caches: list = [None] * a.num_hidden_layers
        for group in kv_layout.groups:
            caches = allocate_kv_caches(len(group.layers), group.num_blocks, block_size,
                                        model.num_kv_heads, a.head_dim, dtype, device,
                                        huge_pages=huge_pages)
            for layer, cache in zip(group.layers, caches):
                self.kv_caches[layer] = cache
        # bf16_prefill (bf16 mode): prompt chunks' attention on bf16 tiles where they run
        self.backend = get_attention_backend(attention_backend, cpu_kernels, device,
                                             model.num_kv_heads, bf16_prefill=bf16_prefill)
        if torch_compile:
            compile_layers(model, self.backend)
        # decode steps replayed from CUDA graphs (runner/cuda_graphs.py); None: always eager
        self.graphs = None
        if cuda_graphs and device.type == "cuda" and self.backend.name == "triton" \
                and not getattr(model, "moe_layers", None):   # MoE routing syncs with the host
            from tokenmill.runner.cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(model, self.kv_caches, self.backend, max_num_seqs,
                                       max_model_len, block_size, device, capture=True,
                                       kv_layout=kv_layout)
        # greedy tokens (and the sampling race's winners) through the C argmax on CPU
        argmax = cpu_ops.argmax_rows if cpu_kernels and device.type == "cpu" else torch_argmax
        self.sampler = Sampler(argmax)
        self.shared_generator = torch.Generator(device=device)
        self.shared_generator.manual_seed(seed)
        self.states: dict[str, RunnerRequestState] = {}
        self.noise_budget = NoiseBudget()   # noise rows drafters keep for the sampler
        self.rejection_sampler = RejectionSampler(argmax)
        self.spec = None   # tokenmill.spec.decoder.SpecDecoder, attached by the engine
        self.faults = faults   # test-only fault injection (tokenmill.runner.faults)

    def release(self, req_ids) -> None:
        for req_id in req_ids:
            self.states.pop(req_id, None)

    # -- state ------------------------------------------------------------------------------
    def _request_seed(self, new) -> Optional[int]:
        """The request's own seed; for a random request without one, a seed drawn from the
        shared generator when the drafter races with the target's noise (it must read a
        row's noise before the target draws it). Same law either way."""
        if new.generator_seed is not None or new.sampling_params is None:
            return new.generator_seed
        if new.sampling_params.is_greedy or not (self.spec is not None and self.spec.couples_noise):
            return None
        return int(torch.randint(0, 2**62, (1,), generator=self.shared_generator,
                                 device=self.shared_generator.device))

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.states.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            seed, generator = self._request_seed(new), None
            if seed is not None:
                generator = make_request_generator(seed, self.device)
            self.states[new.req_id] = RunnerRequestState(
                req_id=new.req_id, prompt_token_ids=list(new.prompt_token_ids),
                output_token_ids=list(new.output_token_ids), params=new.sampling_params,
                block_tables=[list(t) for t in new.block_tables], num_computed_tokens=new.num_computed_tokens,
                seed=seed, generator=generator, pooling_params=new.pooling_params,
                noise_budget=self.noise_budget)
        for cached in so.scheduled_cached_reqs:
            state = self.states[cached.req_id]
            for table, added in zip(state.block_tables, cached.new_block_ids):
                table.extend(added)
            state.num_computed_tokens = cached.num_computed_tokens
            state.forget_passed_blocks(self.kv_layout, self.block_size)
        for req_id, drafts in so.scheduled_spec_token_ids.items():
            self.states[req_id].spec_token_ids = drafts
            self.states[req_id].spec_parents = so.scheduled_spec_parents.get(req_id)
        self.noise_budget.recount(self.states.values())

    # -- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        t_start = time.perf_counter()
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], [])
        inp = build_model_input(so.num_scheduled_tokens, self.states, self.block_size, self.device,
                                self.backend, self.kv_layout)
        if self.faults is not None:
            self.faults.before_forward(inp.req_ids, self.states)
        aux = self._aux_capture()
        hidden = self._forward(inp, aux)
        out = ModelRunnerOutput(req_ids=inp.req_ids, sampled_token_ids=[[] for _ in inp.req_ids])
        bad_hidden_rows = _nonfinite_rows(hidden)
        self._prompt_logprobs(hidden, inp, out)
        pool_rows(hidden, inp.pooling, self.states, out)
        last_rows = inp.logits_indices   # per sample request: hidden row of its newest token
        rejected: dict[str, int] = {}    # drafts rejected per verified request
        tree_rows: dict[str, list] = {}  # per request that verified a tree: its kept rows
        if inp.sample_req_ids:
            logits = self.model.compute_logits(hidden[inp.logits_indices])
            if self.faults is not None:
                self._inject_sampling_faults(logits, inp)
            if inp.num_draft_tokens:
                rows, rejected, tree_rows = self._verify(logits, inp, out, so.grammar_bitmask)
                last_rows = inp.logits_indices[rows]
            else:
                self._sample(logits, inp, out, so.grammar_bitmask)
        _flag_nonfinite(bad_hidden_rows, inp, out)
        features = None if aux is None else self._step_features(inp, out, aux.concat(), rejected,
                                                                 tree_rows)
        for req_id, n in so.num_scheduled_tokens.items():
            self.states[req_id].num_computed_tokens += n
        if self.spec is not None:
            out.draft_token_ids, out.draft_parents = self.spec.after_step(
                self, so, inp, hidden[last_rows], out, t_start, features)
        return out

    def _aux_capture(self) -> Optional[AuxCapture]:
        """What the proposer wants kept from this forward (decoder layers' outputs), or None."""
        layers = () if self.spec is None else self.spec.proposer.aux_layers
        return AuxCapture(layers) if layers else None

    def _step_features(self, inp: ModelInput, out: ModelRunnerOutput, aux_rows: torch.Tensor,
                       rejected: dict, tree_rows: dict) -> StepFeatures:
        """The rows of ``aux_rows`` [T, ...] whose tokens this step verified, per request
        (called before num_computed_tokens advances, after rejected drafts rolled it back);
        ``tree_rows``: a tree's kept rows, counted from its root's."""
        keep, starts, counts, token_ids, block_ids, req_ids = [], [], [], [], [], []
        flat = 0
        for req_id, n in zip(inp.req_ids, inp.attn_meta.query_lens):
            verified = n - rejected.get(req_id, 0)
            if req_id not in out.errors and verified > 0:
                state = self.states[req_id]
                start = state.num_computed_tokens + rejected.get(req_id, 0)   # _verify rolled back
                req_ids.append(req_id)
                starts.append(start)
                counts.append(verified)
                token_ids.append(state.tokens(start, start + verified))
                block_ids.append(state.block_ids)
                kept = tree_rows.get(req_id)
                if kept is None:
                    keep.extend(range(flat, flat + verified))
                else:   # the rows before the root, then the kept path's
                    lead = verified - len(kept)
                    keep.extend([*range(flat, flat + lead), *(flat + lead + r for r in kept)])
            flat += n
        rows = aux_rows[torch.tensor(keep, dtype=torch.int64, device=aux_rows.device)]
        return StepFeatures(req_ids, starts, counts, token_ids, block_ids, rows)

    def _inject_sampling_faults(self, logits: torch.Tensor, inp: ModelInput) -> None:
        """logits [rows, V]: one row per sample request, k + 1 with k drafts."""
        rows = [len(self.states[r].spec_token_ids) + 1 if inp.num_draft_tokens else 1
                for r in inp.sample_req_ids]
        self.faults.poison_logits(logits, inp.sample_req_ids, self.states, rows)
        self.faults.before_sample(inp.sample_req_ids, self.states)

    def _forward(self, inp: ModelInput, aux: Optional[AuxCapture]) -> torch.Tensor:
        """Hidden states [T, hidden] of the step: the one-call C decode stack when it applies
        (decode-sized steps of a plain single-rank Llama stack), a CUDA graph (decode steps on
        the Triton backend, when no layer outputs are wanted), else the model's modules.
        ``aux`` collects the outputs of the layers a drafter reads."""
        if self.graphs is not None and aux is None:
            size = self.graphs.bucket(inp)
            if size is not None:
                return self.graphs.run(inp, size)
        hidden = fused_stack.forward(self.model, inp.input_ids, inp.positions, self.kv_caches,
                                     inp.attn_meta, self.backend, aux)
        if hidden is not None:
            return hidden
        if aux is None:
            return self.model(inp.input_ids, inp.positions, self.kv_caches, inp.attn_meta, self.backend)
        return self.model(inp.input_ids, inp.positions, self.kv_caches, inp.attn_meta, self.backend,
                          aux=aux)

    def _sample(self, logits: torch.Tensor, inp: ModelInput, out: ModelRunnerOutput,
                grammar_bitmask) -> None:
        # logits [num_sample, V]. A row with NaN/inf logits fails only its own request.
        safe_logits, bad_rows = _zero_nonfinite_rows(logits)
        rows = []
        for req_id in inp.sample_req_ids:
            state = self.states[req_id]
            if state.generator is not None:
                state.generator.manual_seed(step_seed(state.seed, len(state.output_token_ids)))
            rows.append(RowSamplingState(state.params, state.prompt_token_ids,
                                         state.output_token_ids, state.generator,
                                         state.drawn_noise.get(len(state.output_token_ids))))
        meta = build_sampling_metadata(rows, self.vocab_size, self.device, self.shared_generator,
                                       bitmask_rows(grammar_bitmask, inp.sample_req_ids, self.device))
        result = self.sampler(safe_logits, meta)
        sampled = result.sampled_token_ids.tolist()
        bad_rows = _flags_list(bad_rows)
        lp = result.logprobs.tolists() if result.logprobs is not None else None
        index = {req_id: i for i, req_id in enumerate(inp.req_ids)}
        for row, req_id in enumerate(inp.sample_req_ids):
            if bad_rows is not None and bad_rows[row]:
                out.errors[req_id] = "the model produced non-finite logits (NaN or inf)"
                continue
            state = self.states[req_id]
            state.output_token_ids.append(sampled[row])
            state.forget_used_noise()
            out.sampled_token_ids[index[req_id]] = [sampled[row]]
            if state.params.logprobs is not None and lp is not None:
                out.logprobs[req_id] = [_position_logprobs(lp, row, state.params.logprobs)]

    def _verify(self, logits: torch.Tensor, inp: ModelInput, out: ModelRunnerOutput,
                grammar_bitmask) -> tuple[list[int], dict, dict]:
        """logits [sum(k + 1), V]: each sample request's newest token and its k drafts. Row j
        is shaped as if the drafts before it were output already, and seeded rows draw at
        output position n0 + j, like plain sampling (a tree's node: after its ancestors, at
        n0 + its depth; spec/draft_tree.py). Returns the logits row of each request's last
        emitted token (the drafter continues from its hidden state), the number of drafts each
        request had rejected and, for trees, the kept rows from the root's."""
        rows, drafts, parents, row_req_ids = [], [], [], []
        for req_id in inp.sample_req_ids:
            state = self.states[req_id]
            drafts.append(state.spec_token_ids)
            parents.append(state.spec_parents)
            row_req_ids += [req_id] * (len(state.spec_token_ids) + 1)
            n0 = len(state.output_token_ids)
            # a tree's rows at one depth draw at one position: a seeded request's siblings
            # share that position's noise row, drawn once (a 49k-token row: ~0.3 ms)
            shared = {} if state.spec_parents is not None and coupled(state) else None
            for depth, history in _row_histories(state.spec_token_ids, state.spec_parents):
                generator = None if state.seed is None else make_request_generator(
                    step_seed(state.seed, n0 + depth), self.device)
                noise = state.drawn_noise.get(n0 + depth)
                if noise is None and shared is not None:
                    noise = shared.get(depth)
                    if noise is None:
                        noise = shared[depth] = position_noise(state.seed, n0 + depth,
                                                               self.vocab_size, self.device)
                rows.append(RowSamplingState(state.params, state.prompt_token_ids,
                                             state.output_token_ids + history, generator, noise))
        logits, bad_rows = _zero_nonfinite_rows(logits)
        meta = build_sampling_metadata(rows, self.vocab_size, self.device, self.shared_generator,
                                       bitmask_rows(grammar_bitmask, row_req_ids, self.device))
        res = self.rejection_sampler(logits, meta, drafts, draft_parents=parents)
        bad_rows = _flags_list(bad_rows)
        lp = res.logprobs.tolists() if res.logprobs is not None else None
        index = {req_id: i for i, req_id in enumerate(inp.req_ids)}
        last_rows, rejected, tree_rows, moves = [], {}, {}, []
        for b, req_id in enumerate(inp.sample_req_ids):
            state, start, tokens = self.states[req_id], res.row_starts[b], res.token_ids[b]
            emitted = res.emitted_rows[b]
            last_rows.append(emitted[-1])
            if state.spec_parents is not None:
                tree_rows[req_id] = [row - start for row in emitted]
            num_rejected = len(state.spec_token_ids) - res.num_accepted[b]
            rejected[req_id] = num_rejected
            state.spec_token_ids, state.spec_parents = [], None
            if bad_rows is not None and any(bad_rows[start:start + num_rejected + len(tokens)]):
                out.errors[req_id] = "the model produced non-finite logits (NaN or inf)"
                continue
            # a kept alternative's K/V goes to its position's slot (the chain's node had it)
            root = state.num_tokens - 1
            moves += [(state.block_tables, root + row - start, root + depth)
                      for depth, row in enumerate(emitted[1:], 1) if row - start != depth]
            state.num_computed_tokens -= num_rejected   # their KV slots are overwritten later
            state.output_token_ids.extend(tokens)
            state.forget_used_noise()
            out.sampled_token_ids[index[req_id]] = tokens
            if state.params.logprobs is not None and lp is not None:
                out.logprobs[req_id] = [_position_logprobs(lp, row, state.params.logprobs)
                                        for row in emitted]
        if moves:
            move_kv_positions(self.kv_caches, self.kv_layout, self.block_size, moves)
        return last_rows, rejected, tree_rows

    def _prompt_logprobs(self, hidden: torch.Tensor, inp: ModelInput, out: ModelRunnerOutput) -> None:
        for sl in inp.prompt_logprobs:
            num_top = self.states[sl.req_id].params.prompt_logprobs
            idx = torch.tensor(sl.hidden_indices, dtype=torch.int64, device=self.device)
            logits = self.model.compute_logits(hidden[idx])
            targets = torch.tensor(sl.next_token_ids, dtype=torch.int64, device=self.device)
            lp = compute_logprobs(logits, targets, num_top).tolists()
            entries = [_position_logprobs(lp, r, num_top) for r in range(len(sl.next_token_ids))]
            # Entry k describes the prompt token at position first_position + 1 + k.
            out.prompt_logprobs[sl.req_id] = (sl.first_position + 1, entries)


def _nonfinite_rows(x: torch.Tensor):
    """Rows of x [R, D] (the step's hidden states or logits) holding NaN/inf: on a CPU a list
    of flags read at once, or None when no row does (cpu_ops.nonfinite_rows); on a GPU the
    [R] bool device mask itself, read once the step's results are (``_flags_list`` after the
    sampled tokens), so the check adds no host sync inside it."""
    if x.device.type == "cpu":
        return cpu_ops.nonfinite_rows(x)
    return ~torch.isfinite(x).all(dim=-1)


def _flags_list(bad) -> Optional[list[bool]]:
    """``_nonfinite_rows``' result as a list of flags, or None when no row is bad."""
    if bad is None or isinstance(bad, list):
        return bad
    flags = bad.tolist()
    return flags if any(flags) else None


def _row_histories(drafts: list[int], parents: Optional[list[int]]):
    """(depth, drafts before the row) of each verification row: the root's, then each
    draft's (a chain's draft j: drafts[:j + 1]; a tree node: its ancestors and itself)."""
    yield 0, []
    if parents is None:
        for j in range(len(drafts)):
            yield j + 1, drafts[:j + 1]
        return
    paths: list[list[int]] = []
    for token, parent in zip(drafts, parents):
        paths.append((paths[parent] if parent >= 0 else []) + [token])
        yield len(paths[-1]), paths[-1]


def _zero_nonfinite_rows(logits: torch.Tensor):
    """(logits with NaN/inf rows zeroed so sampling stays defined, ``_nonfinite_rows``)."""
    flags = _nonfinite_rows(logits)
    if flags is None:
        return logits, None
    bad = torch.tensor(flags, device=logits.device) if isinstance(flags, list) else flags
    return torch.where(bad.unsqueeze(-1), torch.zeros_like(logits), logits), flags


def _flag_nonfinite(bad_rows, inp: ModelInput, out: ModelRunnerOutput) -> None:
    """A request whose hidden states went NaN/inf in any chunk fails (only it), so its KV
    blocks are never published to the prefix cache. ``bad_rows``: ``_nonfinite_rows`` of
    the step's hidden states [T, H]; a request already failed by its logits keeps that
    error."""
    flags = _flags_list(bad_rows)
    if flags is None:
        return
    start = 0
    for req_id, n in zip(inp.req_ids, inp.attn_meta.query_lens):
        if any(flags[start:start + n]) and req_id not in out.errors:
            out.errors[req_id] = "the model produced non-finite activations (NaN or inf)"
        start += n


def _position_logprobs(lp, row: int, num_top: int) -> dict:
    """{token_id: Logprob} for the chosen token plus the top ``num_top`` of one row."""
    token_ids, logprobs, ranks = lp
    entry = {token_ids[row][0]: Logprob(logprobs[row][0], ranks[row])}
    for k in range(1, num_top + 1):
        tok = token_ids[row][k]
        if tok not in entry:
            entry[tok] = Logprob(logprobs[row][k], k)
    return entry
