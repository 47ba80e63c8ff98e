"""Plain, obviously-correct paged attention: the test oracle for every faster backend."""

from __future__ import annotations

from typing import Optional

import torch

from tokenmill.layers.attention.base import AttentionBackend, check_gqa, write_kv
from tokenmill.layers.attention.kv_quant import QuantizedKV
from tokenmill.layers.attention.metadata import AttentionMetadata


class ReferenceAttention(AttentionBackend):
    """One request at a time: gather its K/V, explicit scores, mask, softmax, matmul (fp32)."""

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
    if isinstance(k_cache, QuantizedKV):
        return k_cache.read_slots(slots), v_cache.read_slots(slots)
    return k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]


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
