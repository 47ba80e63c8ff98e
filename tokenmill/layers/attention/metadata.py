"""Per-step attention metadata for a mixed batch over a paged KV cache.

Terms:
- query tokens: the tokens of a request computed in this step (a prefill chunk, one decode
  token, or 1 + k speculative tokens); ``query_len`` of them per request.
- context / seq_len: every token of the request whose K/V is in the cache *after* this step
  writes its own tokens, so the query tokens are the last ``query_len`` of ``seq_len``.
- slot: ``block_id * block_size + offset``, the row of a cache viewed as
  ``[num_blocks * block_size, num_kv_heads, head_dim]``.
- index position: ``seq_len - query_len + i`` for query token i of a request; its K/V are
  written to the slot of that position (``slot_mapping``).
- draft tree: a speculative run whose query tokens are the root, a chain of draft nodes and
  leaf alternatives. A chain node sits at its index position; an alternative to the chain
  node at depth d sits at position ``seq_len - query_len + d`` (``query_positions``), sees
  the keys before it, and its own key at its index position's slot.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class AttentionMetadata:
    num_tokens: int                # T = total query tokens this step
    query_start_loc: torch.Tensor  # [B+1] int64, cumulative query lengths
    seq_lens: torch.Tensor         # [B] int64, context length after this step's tokens
    block_tables: torch.Tensor     # [B, max_num_blocks] int64, padded with 0
    slot_mapping: torch.Tensor     # [T] int64, flat cache slot of each query token
    query_lens: list[int]
    seq_lens_list: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Per-step derived tensors a backend computes on the first layer and reuses on the rest
    # (index lists, masks). Lives and dies with this step's metadata object.
    plan_cache: dict = field(default_factory=dict, repr=False, compare=False)
    # attention window -> the metadata (own block tables and slots) of the KV group whose
    # layers attend with it (kv/layout.py); windows not named here use this one
    by_window: dict = field(default_factory=dict, repr=False, compare=False)
    # host [T] int64 (request index, position) of each query token: another KV group's slots
    # come from them (with_tables)
    token_positions: tuple = field(default=(), repr=False, compare=False)
    # per request: the run computes prompt tokens (set by the runner; () = none known). A
    # backend computes such rows as it computes a prefill, whatever the run's length, so a
    # prompt's bits do not depend on how much of it a prefix-cache hit covered
    prompt_runs: tuple = field(default=(), repr=False, compare=False)
    # host [T] int64: each query token's position when the step verifies draft trees (a leaf
    # alternative's position is below its index position; see the terms above); None: the
    # query tokens of a request sit at consecutive positions, their index positions. Set by
    # the runner after build; every KV group shares it (with_tables). Only backends whose
    # supports_draft_trees is True read it
    query_positions: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    def is_prompt_run(self, b: int) -> bool:
        return bool(self.prompt_runs) and self.prompt_runs[b]

    def checked_query_positions(self) -> Optional[torch.Tensor]:
        """query_positions as the C kernels read them ([T] contiguous CPU int64), each checked
        to lie in [0, its index position]: a kernel reads block-table entries at these
        positions, and a larger one would also show the row keys after it. None without
        draft trees. Checked once per step (plan_cache), not once per layer."""
        if self.query_positions is None:
            return None
        key = ("checked_query_positions",)
        if key not in self.plan_cache:
            pos = self.query_positions.to(device="cpu", dtype=torch.int64).contiguous()
            q_lens = torch.tensor(self.query_lens, dtype=torch.int64)
            cu_q = torch.zeros(len(self.query_lens) + 1, dtype=torch.int64)
            torch.cumsum(q_lens, 0, out=cu_q[1:])
            _, index_pos = _token_positions(q_lens, torch.tensor(self.seq_lens_list), cu_q)
            if pos.shape != index_pos.shape or bool((pos < 0).any() or (pos > index_pos).any()):
                raise ValueError("query_positions must hold one position per query token, each "
                                 "in [0, seq_len - query_len + i]")
            moved = pos != index_pos
            self.plan_cache[key] = pos
            self.plan_cache[("tree_runs",)] = tuple(
                bool(moved[s:e].any()) for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()))
        return self.plan_cache[key]

    def tree_runs(self) -> tuple:
        """Per request: does its run hold a row below its index position (a draft tree's
        leaf alternative)? () without draft trees."""
        if self.checked_query_positions() is None:
            return ()
        return self.plan_cache[("tree_runs",)]

    def for_window(self, window) -> "AttentionMetadata":
        """The metadata a layer attending with ``window`` (None: full) reads its cache through."""
        return self.by_window.get(window, self)

    def with_tables(self, block_tables: list[list[int]]) -> "AttentionMetadata":
        """The same step over other block tables (a KV group's): its own tables and slots,
        every other field shared."""
        _validate(self.query_lens, self.seq_lens_list, block_tables, self.block_size)
        tables = _pad_block_tables(block_tables)
        if self.num_tokens <= HOST_INDEX_TOKENS:
            slots = torch.tensor(_host_index(self.query_lens, self.seq_lens_list, block_tables,
                                             self.block_size)[3], dtype=torch.int64)
        else:
            req_idx, positions = self.token_positions
            slots = _slots(tables, req_idx, positions, self.block_size)
        tables, slots = to_device([tables, slots], self.block_tables.device)
        return dataclasses.replace(self, block_tables=tables, slot_mapping=slots, plan_cache={},
                                   by_window={})

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device,
        **extra,
    ) -> "AttentionMetadata":
        """Build tensors from plain lists (the scheduler's view) on ``device``; ``extra``
        fields are a subclass's own."""
        _validate(query_lens, seq_lens, block_tables, block_size)
        tables = _pad_block_tables(block_tables)
        s_lens = torch.tensor(seq_lens, dtype=torch.int64)
        if sum(query_lens) <= HOST_INDEX_TOKENS:
            cu_q, req_idx, positions, slot_mapping = (
                torch.tensor(v, dtype=torch.int64)
                for v in _host_index(query_lens, seq_lens, block_tables, block_size))
        else:
            q_lens = torch.tensor(query_lens, dtype=torch.int64)
            cu_q = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
            torch.cumsum(q_lens, 0, out=cu_q[1:])
            req_idx, positions = _token_positions(q_lens, s_lens, cu_q)
            slot_mapping = _slots(tables, req_idx, positions, block_size)
        cu_q, s_lens, tables, slot_mapping = to_device([cu_q, s_lens, tables, slot_mapping], device)
        return cls(
            num_tokens=int(slot_mapping.shape[0]),
            query_start_loc=cu_q,
            seq_lens=s_lens,
            block_tables=tables,
            slot_mapping=slot_mapping,
            query_lens=list(query_lens),
            seq_lens_list=list(seq_lens),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            block_size=block_size,
            token_positions=(req_idx, positions),
            **extra,
        )


def to_device(tensors: list[torch.Tensor], device) -> list[torch.Tensor]:
    """int64 host tensors on ``device``. Off the CPU they travel in one copy from pinned
    memory (one transfer per step instead of one per tensor), returned as views."""
    device = torch.device(device)
    if device.type == "cpu":
        return tensors
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if device.type == "cuda":
        flat = flat.pin_memory()
    flat = flat.to(device, non_blocking=True)
    out, start = [], 0
    for t in tensors:
        out.append(flat[start:start + t.numel()].view(t.shape))
        start += t.numel()
    return out


def _validate(query_lens, seq_lens, block_tables, block_size) -> None:
    # Caught here, in Python, because a bad index inside a gather is a silent wrong answer
    # (or an opaque device assert) much later.
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError(
            f"length mismatch: {len(query_lens)} query_lens, {len(seq_lens)} seq_lens, "
            f"{len(block_tables)} block_tables")
    for b, (q, s, table) in enumerate(zip(query_lens, seq_lens, block_tables)):
        if not 1 <= q <= s:
            raise ValueError(f"request {b}: need 1 <= query_len ({q}) <= seq_len ({s})")
        needed = -(-s // block_size)
        if len(table) < needed:
            raise ValueError(
                f"request {b}: seq_len {s} needs {needed} blocks, block table has {len(table)}")


def _pad_block_tables(block_tables: list[list[int]]) -> torch.Tensor:
    width = max((len(t) for t in block_tables), default=0)
    width = max(width, 1)  # keep a [B, >=1] shape so indexing code needs no special case
    padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
    return torch.tensor(padded, dtype=torch.int64).reshape(len(block_tables), width)


# Steps of up to this many query tokens (decode, speculative runs) index in plain ints: a
# handful of tensors instead of ~15 small tensor ops, each dearer than its arithmetic once
# the step's weights have streamed through the caches.
HOST_INDEX_TOKENS = 256


def _host_index(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                block_size: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """The values of build's tensor path as lists: cumulative query lengths [B+1], then each
    query token's request index, position and flat cache slot [T]."""
    cu, req_idx, positions, slots = [0], [], [], []
    for b, (q, s, table) in enumerate(zip(query_lens, seq_lens, block_tables)):
        cu.append(cu[-1] + q)
        req_idx += [b] * q
        run = range(s - q, s)
        positions += run
        slots += [table[p // block_size] * block_size + p % block_size for p in run]
    return cu, req_idx, positions, slots


def _token_positions(
    q_lens: torch.Tensor,   # [B]
    s_lens: torch.Tensor,   # [B]
    cu_q: torch.Tensor,     # [B+1]
) -> tuple[torch.Tensor, torch.Tensor]:   # [T] request index, [T] position
    num_tokens = int(cu_q[-1])
    req_idx = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)  # [T]
    # Position of token i of request b is (seq_len - q_len) + i.
    offset_in_run = torch.arange(num_tokens) - cu_q[:-1][req_idx]
    return req_idx, (s_lens - q_lens)[req_idx] + offset_in_run


def _slots(tables: torch.Tensor, req_idx: torch.Tensor, positions: torch.Tensor,
           block_size: int) -> torch.Tensor:   # [T] flat cache slot of each query token
    block_ids = tables[req_idx, positions // block_size]
    return block_ids * block_size + positions % block_size
