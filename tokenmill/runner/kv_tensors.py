"""Preallocated paged KV cache tensors: per layer, K and V of shape
[num_blocks, block_size, num_kv_heads, head_dim]; with a quantized KV dtype (int8, fp8) each
is a ``QuantizedKV`` (values of that shape plus one fp32 scale per slot per KV head)."""
from __future__ import annotations

from typing import Optional

import torch

from tokenmill.layers.attention.kv_quant import (QuantizedKV, cache_zeros, is_quantized_kv_dtype,
                                                  slot_bytes)

# Default pool on CPU when neither num_kv_blocks nor kv_cache_memory is given.
DEFAULT_CPU_KV_BYTES = 2 * 1024**3


_KV_STORAGE = {"fp16": torch.float16, "float16": torch.float16, "bf16": torch.bfloat16,
               "bfloat16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn,
               "fp8_e4m3": torch.float8_e4m3fn}


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """What the cache stores: the model dtype for "auto", else the named (half-precision or
    quantized) dtype."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _KV_STORAGE:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; "
                         f"choose 'auto' or one of {sorted(_KV_STORAGE)}")
    return _KV_STORAGE[kv_cache_dtype]


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    """K and V of every layer for one block, quantization scales included."""
    return 2 * num_layers * block_size * slot_bytes(num_kv_heads, head_dim, dtype)


def kv_cache_nbytes(kv_caches: list) -> int:
    return sum(_nbytes(k) + _nbytes(v) for k, v in kv_caches)


def _nbytes(cache) -> int:
    if isinstance(cache, QuantizedKV):
        return cache.nbytes
    return cache.numel() * cache.element_size()


def decide_num_blocks(num_kv_blocks: Optional[int], kv_cache_memory: Optional[int],
                      gpu_memory_utilization: float, per_block: int, device: torch.device,
                      weight_bytes: int) -> int:
    """Pool size: explicit block count, else a byte budget, else (CUDA) a share of free memory."""
    if num_kv_blocks is not None:
        return num_kv_blocks
    if kv_cache_memory is None:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            kv_cache_memory = int(total * gpu_memory_utilization) - (total - free) - weight_bytes // 10
        else:
            kv_cache_memory = DEFAULT_CPU_KV_BYTES
    num = kv_cache_memory // per_block
    if num < 1:
        raise ValueError(f"KV cache memory of {kv_cache_memory} bytes holds no block "
                         f"({per_block} bytes per block); give it more memory")
    return num


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype, device: torch.device,
                       huge_pages: bool = False) -> list:
    """Per layer (K, V). ``huge_pages``: CPU caches fault in 2 MB pages (utils/hugepages.py)."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if is_quantized_kv_dtype(dtype):
        return [(QuantizedKV.zeros(shape, dtype, device, huge_pages),
                 QuantizedKV.zeros(shape, dtype, device, huge_pages)) for _ in range(num_layers)]
    return [(cache_zeros(shape, dtype, device, huge_pages), cache_zeros(shape, dtype, device, huge_pages))
            for _ in range(num_layers)]


def move_kv_positions(kv_caches: list, layout, block_size: int, moves: list) -> None:
    """Copy K/V between positions of requests in every layer: ``moves`` holds
    (block_tables per KV group, from position, to position). A kept draft-tree alternative was
    written at its node's slot; its position's slot is where later steps read it."""
    for g, group in enumerate(layout.groups):
        src = torch.tensor([_slot(t[g], a, block_size) for t, a, _ in moves], dtype=torch.int64)
        dst = torch.tensor([_slot(t[g], b, block_size) for t, _, b in moves], dtype=torch.int64)
        for layer in group.layers:
            for cache in kv_caches[layer]:
                for rows in ((cache.values.view(torch.int8), cache.scale)
                             if isinstance(cache, QuantizedKV) else (cache,)):
                    flat = rows.flatten(0, 1)
                    flat.index_copy_(0, dst.to(flat.device), flat.index_select(0, src.to(flat.device)))


def _slot(table: list, position: int, block_size: int) -> int:
    return table[position // block_size] * block_size + position % block_size
