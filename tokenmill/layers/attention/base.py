"""Attention backend interface, the shared cache write, and backend selection."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch

from tokenmill.layers.attention.kv_quant import QuantizedKV, write_quantized_kv
from tokenmill.layers.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Causal attention of a mixed batch over a paged KV cache.

    Query token i of a request with ``q_len`` query tokens and ``seq_len`` context sits at
    position ``seq_len - q_len + i`` and attends to cached keys at positions <= its own
    (and > position - sliding_window when a window is given). Query head h reads KV head
    ``h // (num_heads // num_kv_heads)`` (GQA). Draft trees (``meta.query_positions``, only
    where ``supports_draft_trees``) place some tokens lower: see metadata.py.
    """

    name: str
    cpu_kernels: bool = False   # uses the fused C kernels (the CPU backend, when asked to)
    # attends draft trees (AttentionMetadata.query_positions); a backend that says no must
    # not be given a step that verifies one
    supports_draft_trees: bool = False

    def build_metadata(self, query_lens: list[int], seq_lens: list[int],
                       block_tables: list[list[int]], block_size: int,
                       device: torch.device) -> AttentionMetadata:
        """The step's metadata from the scheduler's plain lists; a backend that needs more
        (the Triton backend's context splits) returns its own subclass."""
        return AttentionMetadata.build(query_lens, seq_lens, block_tables, block_size, device)

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,    # [T, num_heads, head_dim]
        key: torch.Tensor,      # [T, num_kv_heads, head_dim], this step's K, rotary applied
        value: torch.Tensor,    # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: Optional[int] = None,
    ) -> torch.Tensor:          # [T, num_heads, head_dim]
        """Write key/value into the caches at ``meta.slot_mapping``, then attend."""


def write_kv(
    key: torch.Tensor,           # [T, num_kv_heads, head_dim]
    value: torch.Tensor,         # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,       # [num_blocks, block_size, num_kv_heads, head_dim] or QuantizedKV
    v_cache: torch.Tensor,       # [num_blocks, block_size, num_kv_heads, head_dim] or QuantizedKV
    slot_mapping: torch.Tensor,  # [T] int64 flat slots
) -> None:
    """Store this step's K/V at their slots, in place (quantizing them for a QuantizedKV)."""
    if isinstance(k_cache, QuantizedKV):
        write_quantized_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    # A non-contiguous cache would make flatten() return a copy and the write would vanish.
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    k_flat = k_cache.flatten(0, 1)  # [num_slots, num_kv_heads, head_dim] view
    v_flat = v_cache.flatten(0, 1)
    k_flat.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def check_gqa(num_heads: int, num_kv_heads: int) -> int:
    """Return the number of query heads per KV head, or raise on a bad ratio."""
    if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return num_heads // num_kv_heads


BACKEND_NAMES = ("reference", "cpu", "triton", "auto")


def resolve_backend_name(name: str, device: torch.device) -> str:
    """"auto" -> "triton" on a CUDA device where the triton package is installed (the
    ``cuda`` extra), else "cpu" (plain PyTorch ops: right on any device)."""
    if name != "auto":
        return name
    if torch.device(device).type == "cuda" and _triton_installed():
        return "triton"
    return "cpu"


def _triton_installed() -> bool:
    import importlib.util
    return importlib.util.find_spec("triton") is not None


def get_attention_backend(name: str = "auto", cpu_kernels: bool = True,
                          device: torch.device = torch.device("cpu"),
                          num_kv_heads: int = 1, bf16_prefill: bool = False) -> AttentionBackend:
    """Return a backend by name: "reference", "cpu", "triton" or "auto" (``cpu_kernels``:
    whether the CPU backend may use the fused C kernel; ``num_kv_heads``: this rank's;
    ``bf16_prefill``: bf16 mode, whose prompt chunks the CPU backend attends on bf16 tiles).

    "auto" picks by device (see resolve_backend_name). Imports are lazy so that backends
    may import this module without a cycle, and so that Triton never loads unless asked for.
    """
    name = resolve_backend_name(name, device)
    if name == "triton":
        from tokenmill.layers.attention.triton import TritonAttention
        return TritonAttention(device, num_kv_heads)
    if name in ("cpu", "auto"):
        from tokenmill.layers.attention.cpu import CpuAttention
        return CpuAttention(cpu_kernels, bf16_prefill)
    if name == "reference":
        from tokenmill.layers.attention.reference import ReferenceAttention
        return ReferenceAttention()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {list(BACKEND_NAMES)}")
