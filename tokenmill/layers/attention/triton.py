"""Paged attention on CUDA through Triton kernels (triton_kernels.py, imported lazily).

The backend builds its own metadata: the step's index tensors reach the device in one copy,
and ``num_splits`` (flash-decoding: the context of each sequence split over several programs)
is decided once per step from the host-side lengths, so the kernels never read a length back
to the host and a captured CUDA graph stays valid for any context length.

On a CPU the same kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by the tests):
that is how the CUDA path is tested where there is no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tokenmill.layers.attention.base import AttentionBackend, check_gqa
from tokenmill.layers.attention.kv_quant import QuantizedKV
from tokenmill.layers.attention.metadata import AttentionMetadata

# Streaming multiprocessors assumed when the device reports none (the interpreter): an H100's.
_DEFAULT_NUM_SMS = 132
# Steps whose longest query is at most this (decode, speculative runs) may split the context.
_MAX_SPLIT_QUERY_LEN = 16


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    num_splits: int = 1   # programs per (sequence, KV head) over the context


def triton_available(device: torch.device) -> bool:
    """Whether Triton kernels can run on ``device``: a CUDA GPU, or the interpreter on CPU."""
    try:
        import triton
    except ImportError:
        return False
    if device.type == "cuda":
        return True
    return bool(triton.knobs.runtime.interpret)


class TritonAttention(AttentionBackend):
    """Mixed steps (prefill chunks over cached context, decode, speculative runs) in one
    kernel; long contexts of few sequences split over the context."""

    name = "triton"

    def __init__(self, device: torch.device, num_kv_heads: int = 1) -> None:
        if not triton_available(device):
            raise ValueError(
                "the triton attention backend needs the triton package and a CUDA GPU (or, on "
                "a CPU, Triton's interpreter: TRITON_INTERPRET=1, for tests); use "
                "attention_backend='cpu' or 'auto'")
        self.num_kv_heads = num_kv_heads   # this rank's: the split heuristic counts programs
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else _DEFAULT_NUM_SMS)

    def build_metadata(self, query_lens: list[int], seq_lens: list[int],
                       block_tables: list[list[int]], block_size: int,
                       device: torch.device) -> TritonAttentionMetadata:
        from tokenmill.layers.attention.triton_kernels import choose_num_splits
        splits = 1   # prefill chunks fill the GPU with query tiles; their split buffers would be big
        if max(query_lens, default=0) <= _MAX_SPLIT_QUERY_LEN:
            splits = choose_num_splits(len(seq_lens), self.num_kv_heads,
                                       max(seq_lens, default=0), self.num_sms)
        return TritonAttentionMetadata.build(query_lens, seq_lens, block_tables, block_size,
                                             device, num_splits=splits)

    def forward(
        self,
        query: torch.Tensor,    # [T, num_heads, head_dim]
        key: torch.Tensor,      # [T, num_kv_heads, head_dim]
        value: torch.Tensor,    # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] or QuantizedKV
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: Optional[int] = None,
    ) -> torch.Tensor:          # [T, num_heads, head_dim]
        from tokenmill.layers.attention import triton_kernels as tk
        k_values, k_scale = _cache_parts(k_cache)
        v_values, v_scale = _cache_parts(v_cache)
        check_gqa(query.shape[1], k_values.shape[2])
        tk.write_kv(key, value, k_values, v_values, meta.slot_mapping, k_scale, v_scale)
        return tk.paged_attention(
            query, k_values, v_values, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.max_query_len, scale, sliding_window, k_scale, v_scale,
            num_splits=getattr(meta, "num_splits", 1))


def _cache_parts(cache) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(values, per-slot scales or None) of a float or quantized cache."""
    if isinstance(cache, QuantizedKV):
        return cache.values, cache.scale
    return cache, None
