"""Plain, obviously-correct paged attention: the test oracle for every faster backend."""

from __future__ import annotations

from typing import Optional

import torch

from tokenmill.layers.attention.base import AttentionBackend, check_gqa, write_kv
from tokenmill.layers.attention.kv_quant import QuantizedKV
from tokenmill.layers.attention.metadata import AttentionMetadata


class ReferenceAttention(AttentionBackend):
    """One request at a time: gather its K/V, explicit scores, mask, softmax, matmul (fp32).
    Draft trees (``meta.query_positions``): one row at a time, over the keys before its
    position read through the block table and its own K/V read from the slot it was written
    to (metadata.py's terms). It computes them as the tests' oracle for the C kernel
    (supports_draft_trees stays the base class's False)."""

    name = "reference"

    def forward(
        self,
        query: torch.Tensor,    # [T, num_heads, head_dim]
        key: torch.Tensor,      # [T, num_kv_heads, head_dim]
        value: torch.Tensor,    # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: Optional[int] = None,
    ) -> torch.Tensor:          # [T, num_heads, head_dim]
        write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        group = check_gqa(query.shape[1], k_cache.shape[2])
        out = torch.empty_like(query)
        start = 0
        for b, (q_len, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens_list)):
            k, v = gather_context(k_cache, v_cache, meta.block_tables[b], seq_len)
            if meta.query_positions is not None:
                for row in range(start, start + q_len):
                    out[row] = _attend_tree_row(query[row], k, v, k_cache, v_cache, meta, row,
                                                group, scale, sliding_window).to(out.dtype)
            else:
                q = query[start:start + q_len]
                out[start:start + q_len] = _attend_one(
                    q, k, v, group, scale, sliding_window).to(out.dtype)
            start += q_len
        return out


def gather_context(
    k_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_num_blocks] int64
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [seq_len, num_kv_heads, head_dim]
    """K/V of positions [0, seq_len) of one request, read slot by slot."""
    block_size = k_cache.shape[1]
    positions = torch.arange(seq_len, device=block_table.device)
    slots = block_table[positions // block_size] * block_size + positions % block_size
    return read_slots(k_cache, slots), read_slots(v_cache, slots)


def read_slots(cache, slots: torch.Tensor) -> torch.Tensor:   # [n, num_kv_heads, head_dim]
    """The K or V rows of flat slots ``slots`` (dequantized for a QuantizedKV)."""
    if isinstance(cache, QuantizedKV):
        return cache.read_slots(slots)
    return cache.flatten(0, 1)[slots]


def _attend_tree_row(
    q: torch.Tensor,  # [num_heads, head_dim] query row ``row`` of the step
    k: torch.Tensor,  # [seq_len, num_kv_heads, head_dim] its request's context, position order
    v: torch.Tensor,
    k_cache, v_cache, meta: AttentionMetadata, row: int, group: int, scale: float,
    sliding_window: Optional[int],
) -> torch.Tensor:    # [num_heads, head_dim] fp32
    """A row at position p = query_positions[row]: keys at positions < p from the context,
    then its own K/V from the slot it was written to (slot_mapping[row]), which holds the
    chain node's in the context when the row is a leaf alternative."""
    p = int(meta.query_positions[row])
    own = meta.slot_mapping[row:row + 1]
    k_row = torch.cat([k[:p], read_slots(k_cache, own).to(k.dtype)])
    v_row = torch.cat([v[:p], read_slots(v_cache, own).to(v.dtype)])
    return _attend_one(q[None], k_row, v_row, group, scale, sliding_window)[0]


def _attend_one(
    q: torch.Tensor,  # [q_len, num_heads, head_dim]
    k: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    v: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    group: int,
    scale: float,
    sliding_window: Optional[int],
) -> torch.Tensor:    # [q_len, num_heads, head_dim] fp32
    q_len, seq_len = q.shape[0], k.shape[0]
    k = k.float().repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [H, q_len, seq_len]
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
    k_pos = torch.arange(seq_len, device=q.device)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)
