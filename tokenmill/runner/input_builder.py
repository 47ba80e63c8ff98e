"""SchedulerOutput + runner request states -> ModelInput tensors (a pure function)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from tokenmill.kv.layout import NULL_BLOCK, KVLayout, first_live_block
from tokenmill.layers.attention.base import AttentionBackend
from tokenmill.layers.attention.metadata import AttentionMetadata, to_device
from tokenmill.pooling_params import PoolingParams
from tokenmill.sample.noise_budget import NoiseBudget
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec import draft_tree


@dataclass
class RunnerRequestState:
    """What the runner keeps per request between steps."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    block_tables: list[list[int]]   # per KV group (kv/layout.py), group 0 first
    num_computed_tokens: int
    seed: Optional[int]
    generator: Optional[torch.Generator] = None
    spec_token_ids: list[int] = field(default_factory=list)   # drafts scheduled this step
    spec_parents: Optional[list[int]] = None   # their parents when they form a tree (spec/draft_tree.py)
    # output position -> [V] Exp(1) noise a coupled drafter drew ahead (spec/coupled.py);
    # the sampler takes it instead of drawing the same values again
    drawn_noise: dict = field(default_factory=dict)
    noise_budget: Optional[NoiseBudget] = None   # the runner's cap on all kept rows
    pooling_params: Optional[PoolingParams] = None   # a prompt-only (pooling) request
    # Pooling so far, float32 [hidden]: the sum of the computed prompt rows (mean) or the
    # newest row (last); chunks of a prompt add to it step by step.
    pooled: Optional[torch.Tensor] = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def block_ids(self) -> list[int]:
        """Group 0's table: every block of the request (drafters index their own caches by it)."""
        return self.block_tables[0]

    def forget_passed_blocks(self, layout: KVLayout, block_size: int) -> None:
        """Point a windowed group's entries the window has passed at its null block, as the
        scheduler returned those blocks to the pool (another request may now write them)."""
        for group, table in zip(layout.groups, self.block_tables):
            end = min(first_live_block(self.num_computed_tokens, group.window, block_size), len(table))
            j = end - 1
            while j >= 0 and table[j] != NULL_BLOCK:   # back to the last step's null entries
                table[j] = NULL_BLOCK
                j -= 1

    def forget_used_noise(self) -> None:
        """Drop the drawn noise of positions already emitted; the rest stays valid (a row's
        noise depends on (seed, position) only), so a rejected draft's position keeps it."""
        if self.drawn_noise:
            n = len(self.output_token_ids)
            self.drawn_noise = {p: row for p, row in self.drawn_noise.items() if p >= n}

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output + this step's drafts, without building the
        whole sequence (a decode step asks for one token of a long one)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        head = self.prompt_token_ids[start:] if start < n else []
        tail = self.output_token_ids[max(start - n, 0):end - n]
        m = n + len(self.output_token_ids)
        if end > m:   # the step's draft tokens follow the newest token
            tail = tail + self.spec_token_ids[max(start - m, 0):end - m]
        return head + tail


@dataclass
class PromptLogprobsSlice:
    """Rows of the hidden states whose next token is a prompt token (for prompt_logprobs)."""

    req_id: str
    hidden_indices: list[int]     # into the flat [T] step
    next_token_ids: list[int]
    first_position: int           # position of the first row's token


@dataclass
class PoolingSlice:
    """A pooling request's rows of the flat [T] step: ``num_rows`` from ``first_row``."""

    req_id: str
    first_row: int
    num_rows: int
    completes_prompt: bool        # the step computes its last prompt row: pool and report


@dataclass
class ModelInput:
    input_ids: torch.Tensor            # [T] int64
    positions: torch.Tensor            # [T] int64
    attn_meta: AttentionMetadata
    req_ids: list[str]                 # scheduled requests, batch order
    sample_req_ids: list[str]          # those that sample a token this step
    logits_indices: torch.Tensor       # [num_sample] int64: their last token's row
    prompt_logprobs: list[PromptLogprobsSlice] = field(default_factory=list)
    # Per sample request: k drafts scored at k + 1 logits rows. Empty when no request has drafts
    # (then logits_indices holds one row per sample request).
    num_draft_tokens: list[int] = field(default_factory=list)
    # Per sample request: how deep its drafts go (a chain: k; a tree: its chain's length)
    draft_depths: list[int] = field(default_factory=list)
    pooling: list[PoolingSlice] = field(default_factory=list)   # never in sample_req_ids


def build_model_input(num_scheduled_tokens: dict[str, int], states: dict[str, RunnerRequestState],
                      block_size: int, device: torch.device,
                      backend: Optional[AttentionBackend] = None,
                      kv_layout: Optional[KVLayout] = None) -> ModelInput:
    """``backend`` builds the attention metadata (its own kind); None: the plain kind.
    ``kv_layout``: groups past the first get metadata of their own (``meta.by_window``)."""
    input_ids: list[int] = []
    positions: list[int] = []
    query_lens, seq_lens, block_tables, prompt_runs = [], [], [], []
    sample_req_ids, logits_indices, prompt_slices, pooling = [], [], [], []
    num_draft_tokens: list[int] = []
    draft_depths: list[int] = []
    trees = False   # a request verifies a draft tree: its nodes sit at root + depth
    req_ids = list(num_scheduled_tokens)
    for req_id in req_ids:
        state, n = states[req_id], num_scheduled_tokens[req_id]
        start, end = state.num_computed_tokens, state.num_computed_tokens + n
        offset = len(input_ids)
        input_ids.extend(state.tokens(start, end))
        positions.extend(range(start, end))
        if state.spec_parents is not None and end > state.num_tokens:
            first = len(positions) - (end - state.num_tokens)     # the drafts' rows
            positions[first:] = [state.num_tokens - 1 + d for d in draft_tree.depths(state.spec_parents)]
            trees = True
        query_lens.append(n)
        seq_lens.append(end)
        block_tables.append(state.block_tables)
        prompt_runs.append(start < len(state.prompt_token_ids))
        if state.pooling_params is not None:   # prompt-only: pooled, never sampled
            pooling.append(PoolingSlice(req_id, offset, n, end >= state.num_tokens))
        elif end >= state.num_tokens:   # reached the newest token (+ k drafts): sample after each
            num_drafts = end - state.num_tokens
            sample_req_ids.append(req_id)
            logits_indices.extend(range(offset + n - 1 - num_drafts, offset + n))
            num_draft_tokens.append(num_drafts)
            draft_depths.append(draft_tree.chain_length(state.spec_parents[:num_drafts])
                                if state.spec_parents is not None else num_drafts)
        if state.params.prompt_logprobs is not None:
            prompt_slice = _prompt_logprobs_slice(state, start, end, offset)
            if prompt_slice is not None:
                prompt_slices.append(prompt_slice)
    build = backend.build_metadata if backend is not None else AttentionMetadata.build
    meta = build(query_lens, seq_lens, [t[0] for t in block_tables], block_size, device)
    meta.prompt_runs = tuple(prompt_runs)
    positions_host = torch.tensor(positions, dtype=torch.int64)
    if trees:   # host positions for the attention kernel (rows whose own key sits elsewhere)
        meta.query_positions = positions_host
    if kv_layout is not None and len(kv_layout.groups) > 1:
        group_metas = [meta] + [meta.with_tables([t[g] for t in block_tables])
                                for g in range(1, len(kv_layout.groups))]
        meta.by_window = {w: group_metas[g] for w, g in kv_layout.group_of_window().items() if g}
    ids_t, positions_t, logits_t = to_device(
        [torch.tensor(input_ids, dtype=torch.int64), positions_host,
         torch.tensor(logits_indices, dtype=torch.int64)], device)
    return ModelInput(
        input_ids=ids_t, positions=positions_t,
        attn_meta=meta, req_ids=req_ids, sample_req_ids=sample_req_ids,
        logits_indices=logits_t,
        prompt_logprobs=prompt_slices, pooling=pooling,
        num_draft_tokens=num_draft_tokens if any(num_draft_tokens) else [],
        draft_depths=draft_depths if any(num_draft_tokens) else [])


def _prompt_logprobs_slice(state: RunnerRequestState, start: int, end: int,
                           offset: int) -> Optional[PromptLogprobsSlice]:
    """Rows at positions p in [start, end) with p + 1 still inside the prompt."""
    last = min(end, len(state.prompt_token_ids) - 1)
    if start >= last:
        return None
    return PromptLogprobsSlice(
        req_id=state.req_id,
        hidden_indices=[offset + p - start for p in range(start, last)],
        next_token_ids=state.prompt_token_ids[start + 1:last + 1],
        first_position=start)
