"""SpecDecoder: the runner's handle on speculative decoding. After each step it (1) records
what the step cost and produced, for the adaptive choice of k and the counters, (2) chooses k
for the next step and (3) asks the proposer for that many drafts per request.

Timing attribution: a step that verifies drafts is charged its own time (forward + rejection
sampling, from ``t_start``, the runner's step start, to ``after_step``), the drafting time
spent after the previous step to produce those drafts, and the time outside the runner until
the next step starts (the engine's output processing and the next schedule: a verify step
emits and schedules several tokens per request, and on a small model that is a fifth of a
step). That last part is known only when the next step starts, so a step's timing is
recorded then; a step that the next one does not continue (none of its requests) is left
out, as the engine may have idled in between. Only steps where every scheduled
request was decoding (no prefill chunk) feed the adaptive choice, the plain step cost c(B) and
the estimated speedup; counters and draft / verify times count every step. Terms are defined
in tokenmill.spec.metrics; per-request stats are kept until ``finish_request`` (called by the
engine when a request finishes or is aborted) moves them to a bounded recent list."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from tokenmill.config import SpeculativeConfig
from tokenmill.spec.adaptive import AdaptiveK, FixedK
from tokenmill.spec.draft_input import DraftInput, StepFeatures
from tokenmill.spec.draft_tree import DraftTree
from tokenmill.spec.metrics import PlainStepCost, SpecDecodingStats


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, proposer, max_model_len: int, block_size: int,
                 k_max: Optional[int] = None) -> None:
        self.config = config
        self.proposer = proposer
        self.k_max = k_max or config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.block_size = block_size
        # candidates per depth when the drafter branches (spec/draft_tree.py), else ()
        self.widths = config.tree_widths if config.speculative_token_tree is not None else ()
        # adaptive with a tree: each proposer mode twice, with its tree and with its chain
        # alone (a tree's extra rows pay where its first choice fails often, at T > 0 and
        # batch 1, and cost more than they earn where verification is compute-bound)
        self.tree_modes = 2 if self.widths and config.adaptive else 1
        modes = len(getattr(proposer, "modes", ("as built",))) * self.tree_modes
        self.controller = AdaptiveK(self.k_max, modes) if config.adaptive else FixedK(self.k_max)
        self.stats = SpecDecodingStats(self.k_max)
        self.plain_cost = PlainStepCost()
        # (batch size, k, proposer mode, draft seconds, ids of the requests drafted for)
        self._pending: Optional[tuple[int, int, int, float, frozenset]] = None
        # the last decode-only step, its timing not recorded yet (_StepTiming), and when the
        # runner left it (after drafting for the next one)
        self._unrecorded: Optional[_StepTiming] = None
        self._step_end = 0.0
        self._drafted: set[str] = set()     # requests the proposer may hold state for

    @property
    def couples_noise(self) -> bool:
        """Does the proposer race random rows with the target's noise (spec/coupled.py)? The
        runner then seeds every random request, so that noise is readable ahead."""
        return getattr(self.proposer, "couples_noise", False)

    @property
    def num_lookahead_tokens(self) -> int:
        return self.k_max if self.proposer.needs_lookahead else 0

    def after_step(self, runner, so, inp, hidden: torch.Tensor, out, t_start: float,
                   features: Optional[StepFeatures] = None) -> tuple[dict, dict]:
        """hidden [num_sample, hidden]: the target's hidden state that produced each sample
        request's newest token; ``features``: the layer outputs the proposer asked for
        (``aux_layers``), for every request the step ran. Returns req_id -> drafts for the
        next step, and req_id -> their parents for the requests whose drafts branch."""
        # Forget requests that left the runner (finished, preempted, or dropped while idle)
        # and requests sent anew (their blocks changed).
        gone = {r for r in self._drafted if r not in runner.states}
        gone |= {n.req_id for n in so.scheduled_new_reqs} & self._drafted
        self.proposer.drop(gone)
        self._drafted -= gone
        self._record_timing(t_start, inp.req_ids)
        self._measure(so, inp, out, time.perf_counter() - t_start)
        try:
            drafts = self._draft_next(runner, inp, hidden, out, features)
        finally:
            self._step_end = time.perf_counter()
        trees = {r: d for r, d in drafts.items() if isinstance(d, DraftTree)}
        for req_id, tree in trees.items():
            drafts[req_id] = tree.tokens
        return drafts, {r: tree.parents for r, tree in trees.items()}

    def _draft_next(self, runner, inp, hidden: torch.Tensor, out,
                    features: Optional[StepFeatures]) -> dict:
        """Chooses k for the next step and asks the proposer for the drafts."""
        index = {req_id: i for i, req_id in enumerate(inp.req_ids)}
        rows = [b for b, r in enumerate(inp.sample_req_ids)
                if r not in out.errors and out.sampled_token_ids[index[r]]]
        if features is not None:
            self._drafted |= set(features.req_ids)
        k, mode = self.controller.choose(len(rows)) if rows else (0, 0)
        if k > 0 and self.plain_cost.wants_sample(len(rows)):
            k = 0       # a plain step now and then measures c(B) (for the estimated speedup)
        proposer_mode, chain_only = divmod(mode, self.tree_modes)
        if rows:
            self.stats.k_chosen[k] = self.stats.k_chosen.get(k, 0) + 1
            if k and proposer_mode:
                self.stats.cheaper_mode_steps += 1
            if k and self.widths and not chain_only:
                self.stats.tree_steps += 1
        if k == 0:
            self._pending = (len(rows), 0, 0, 0.0, frozenset()) if rows else None
            if features is not None:   # no drafts, but the proposer's context must follow
                self._timed_propose(DraftInput([], [], None, features))
            return {}
        states = [runner.states[inp.sample_req_ids[b]] for b in rows]
        caps = [self._cap(s, k) for s in states]
        drafts, seconds = self._timed_propose(DraftInput(states, caps, hidden[rows], features,
                                                         mode=proposer_mode,
                                                         widths=() if chain_only else self.widths))
        ids = frozenset(s.req_id for s in states)
        self._drafted |= ids
        for req_id in ids:
            self.stats.request(req_id).draft_time += seconds
        self._pending = (len(rows), k, mode, seconds, ids)
        return {s.req_id: d for s, d in zip(states, drafts) if d}

    def _timed_propose(self, draft_input: DraftInput) -> tuple[list[list[int]], float]:
        t0 = time.perf_counter()
        drafts = self.proposer.propose(draft_input)
        seconds = time.perf_counter() - t0
        self.stats.draft_time += seconds
        return drafts, seconds

    def finish_request(self, req_id: str) -> None:
        """The engine finished or aborted the request: its stats join the recent list."""
        self.stats.finish(req_id)

    def reset_stats(self) -> None:
        """Fresh counters (the adaptive controller and c(B) keep what they learned)."""
        self.stats = SpecDecodingStats(self.k_max)
        if hasattr(self.proposer, "reset_counts"):
            self.proposer.reset_counts()

    def _cap(self, state, k: int) -> int:
        """Drafts a request can take: none past max_model_len, and a lookahead drafter must
        stay inside the slots the scheduler allocated (it writes positions up to
        num_tokens + k - 2)."""
        cap = min(k, self.max_model_len - state.num_tokens - 1)
        if self.proposer.needs_lookahead:
            cap = min(cap, len(state.block_ids) * self.block_size - state.num_tokens + 1)
        return max(cap, 0)

    def _measure(self, so, inp, out, seconds: float) -> None:
        pending, self._pending = self._pending, None
        # a tree counts as its chain: the controller's per-position model, and tau, read
        # how deep a step's drafts went (alternatives raise a position's acceptance)
        num_drafts = dict(zip(inp.sample_req_ids, inp.draft_depths)) if inp.num_draft_tokens else {}
        emitted = 0
        for req_id, tokens in zip(out.req_ids, out.sampled_token_ids):
            emitted += len(tokens)
            if tokens:
                self.stats.request(req_id).num_output_tokens += len(tokens)
            self.stats.on_verified(num_drafts.get(req_id, 0), len(tokens), req_id, seconds)
        if num_drafts:
            self.stats.num_steps += 1
            self.stats.verify_time += seconds
        # Every scheduled request ran exactly its newest token + drafts: no prefill chunk.
        decode_only = inp.attn_meta.num_tokens == len(inp.sample_req_ids) + sum(inp.num_draft_tokens) \
            and len(inp.sample_req_ids) == len(inp.req_ids)
        if not decode_only or not emitted:
            return
        tokens = {r: len(t) for r, t in zip(out.req_ids, out.sampled_token_ids)}
        self._unrecorded = _StepTiming(list(inp.sample_req_ids), tokens, num_drafts,
                                       bool(num_drafts), seconds, pending, self.stats,
                                       {r: self.stats.request(r) for r in inp.sample_req_ids})

    def _record_timing(self, t_start: float, req_ids: list[str]) -> None:
        """The previous decode-only step's timing, now that the time outside the runner since
        it is known: into c(B), the estimated speedup and the adaptive choice of k."""
        step, self._unrecorded = self._unrecorded, None
        if step is None or set(step.sample_req_ids).isdisjoint(req_ids):
            return   # not continued: the engine may have idled since, the gap is no cost
        seconds = step.seconds + t_start - self._step_end
        batch_size = len(step.sample_req_ids)
        if not step.verified:
            self.plain_cost.record(batch_size, seconds)
        if step.pending is None:
            return
        batch, k, mode, draft_seconds, drafted = step.pending
        self._estimate(step, seconds, draft_seconds, drafted)
        # Every request of a step that chose k, drafts or not: prompt lookup finding nothing
        # is part of what choosing k yields (the controller counts how often drafts come).
        verdicts = [(step.drafts.get(r, 0), step.tokens[r] - 1)
                    for r in step.sample_req_ids if step.tokens.get(r)]
        self.controller.record(batch, k, seconds + draft_seconds, verdicts, mode)

    def _estimate(self, step: "_StepTiming", seconds: float, draft_seconds: float,
                  drafted: frozenset) -> None:
        """Adds one decode-only step to the estimated speedup's sums (tokens x c(B) against
        the step's seconds + the drafting done for it), aggregate and per request (the
        records it had, finished since or not)."""
        sample_req_ids, tokens = step.sample_req_ids, step.tokens
        batch = len(sample_req_ids)
        cost = self.plain_cost.get(batch)
        if cost is None:
            return
        stats = step.stats
        stats.plain_equiv_time += sum(tokens.get(r, 0) for r in sample_req_ids) * cost / batch
        stats.measured_time += seconds + draft_seconds
        for req_id in sample_req_ids:
            if tokens.get(req_id):
                r = step.records[req_id]
                r.plain_equiv_time += tokens[req_id] * cost
                r.measured_time += seconds + (draft_seconds if req_id in drafted else 0.0)

    def snapshot(self) -> dict:
        """Flat ``spec_*`` keys plus ``spec_decode``: the aggregate with vLLM's names, the
        configuration, c(B) per batch bucket and ``requests`` (recent finished + running)."""
        flat = self.stats.snapshot(self.controller.estimated_speedup())
        flat["spec_decode"] = {
            "method": self.config.method, "num_speculative_tokens": self.k_max,
            "adaptive": bool(self.config.adaptive), **self.stats.counters(),
            "k_chosen": dict(sorted(self.stats.k_chosen.items())),
            "plain_step_ms": {b: round(1000 * s, 3) for b, s in sorted(self.plain_cost.seconds.items())},
            "requests": self.stats.requests(),
        }
        return flat


@dataclass
class _StepTiming:
    """A decode-only step whose timing waits for the next step's start."""
    sample_req_ids: list
    tokens: dict              # req_id -> tokens emitted
    drafts: dict              # req_id -> drafts verified (absent: none)
    verified: bool            # some request had drafts
    seconds: float            # the runner's part: t_start to after_step
    pending: Optional[tuple]  # (batch, k, mode, draft seconds, drafted ids) chosen for this step
    stats: SpecDecodingStats  # the counters then (reset_stats may have replaced them since)
    records: dict             # req_id -> its RequestSpecStats then


class LayerSkipModel:
    """The target's first ``num_layers`` decoder layers + its final norm and head: a draft
    model with no weights of its own."""

    def __init__(self, target, num_layers: int) -> None:
        self.target, self.num_layers = target, num_layers

    def __call__(self, input_ids, positions, kv_caches, meta, backend) -> torch.Tensor:
        m = self.target.model
        x = m.embed_tokens(input_ids)                        # [T, hidden]
        for layer, kv_cache in zip(m.layers[:self.num_layers], kv_caches):
            x = layer(positions, x, kv_cache, meta, backend)
        return m.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)


def build_spec_decoder(config: SpeculativeConfig, runner, max_model_len: int, num_blocks: int,
                       cache_dir: Optional[str] = None) -> SpecDecoder:
    """Build the proposer named by ``config.method`` around a ModelRunner's target."""
    from tokenmill.spec.heads import EagleProposer, MedusaProposer, build_eagle, build_medusa
    from tokenmill.spec.ngram import NgramProposer
    from tokenmill.spec.paged_draft import PagedDraftProposer
    target, k = runner.model, config.num_speculative_tokens
    common = dict(backend=runner.backend, block_size=runner.block_size, device=runner.device,
                  vocab=runner.vocab_size)
    if config.method == "ngram":
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    elif config.method == "layer_skip":
        n = config.num_layers or max(1, target.args.num_hidden_layers // 4)
        if n >= target.args.num_hidden_layers:
            raise ValueError(f"layer_skip num_layers ({n}) must be below the target's "
                             f"{target.args.num_hidden_layers} layers")
        proposer = PagedDraftProposer(LayerSkipModel(target, n), runner.kv_caches[:n],
                                      catch_up=False, **common)
    elif config.method == "draft_model":
        draft, caches = _load_draft(config.model, runner, max_model_len, num_blocks, cache_dir)
        proposer = PagedDraftProposer(draft, caches, catch_up=True, **common)
    elif config.method == "eagle3":
        from tokenmill.spec.eagle3 import build_eagle3_proposer
        proposer = build_eagle3_proposer(config, runner, num_blocks)
    elif config.method == "dflash":
        from tokenmill.spec.dflash import build_dflash_proposer
        proposer = build_dflash_proposer(config, runner, num_blocks)
    elif config.method == "medusa":
        heads = build_medusa(config.model, target, k, config.seed, runner.device)
        k = min(k, heads.num_heads)
        proposer = MedusaProposer(heads, target)
    else:
        proposer = EagleProposer(build_eagle(config.model, target, config.seed, runner.device),
                                 target, runner.backend, runner.device)
    if config.ngram_first:
        from tokenmill.spec.lookup_first import LookupFirstProposer
        proposer = LookupFirstProposer(NgramProposer(config.prompt_lookup_min,
                                                     config.prompt_lookup_max), proposer)
    if config.speculative_token_tree is not None and not getattr(runner.backend, "supports_draft_trees", False):
        raise ValueError(f"speculative_token_tree: the {runner.backend.name!r} attention backend "
                         "verifies chains only (draft trees need the CPU attention kernels)")
    # a drafter may draft fewer per step than asked (DFlash: block size - 1)
    k = min(k, getattr(proposer, "max_drafts", k))
    return SpecDecoder(config, proposer, max_model_len, runner.block_size, k_max=k)


def _load_draft(path: str, runner, max_model_len: int, num_blocks: int, cache_dir):
    from tokenmill.models.hub import resolve_model
    from tokenmill.models.loader import open_checkpoint
    from tokenmill.runner.kv_tensors import allocate_kv_caches
    from tokenmill.runner.model_loader import build_model
    dtype = runner.kv_caches[0][0].dtype
    draft = build_model(open_checkpoint(resolve_model(path, cache_dir=cache_dir)), runner.device,
                        dtype, max_model_len, cpu_kernels=runner.backend.cpu_kernels)
    if draft.args.vocab_size != runner.vocab_size:
        raise ValueError(f"draft model vocabulary ({draft.args.vocab_size}) differs from the "
                         f"target's ({runner.vocab_size}); they must share the tokenizer")
    a = draft.args
    caches = allocate_kv_caches(a.num_hidden_layers, num_blocks, runner.block_size,
                                a.num_key_value_heads, a.head_dim, dtype, runner.device)
    return draft, caches
