"""Preallocated paged KV cache tensors: per layer, K and V of shape
[num_blocks, block_size, num_kv_heads, head_dim]."""
from __future__ import annotations

from typing import Optional

import torch

# Default pool on CPU when neither num_kv_blocks nor kv_cache_memory is given.
DEFAULT_CPU_KV_BYTES = 2 * 1024**3


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    elem = torch.empty(0, dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


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
                       head_dim: int, dtype: torch.dtype, device: torch.device) -> list:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device)) for _ in range(num_layers)]
