"""Quantized paged KV cache: int8 or fp8 (E4M3) values with one fp32 scale per written slot
per KV head.

Terms:
- slot scale: ``amax(|x|) / qmax`` over head_dim of one token's K (or V) in one KV head;
  ``x ~= q * scale``. Each write quantizes only its own tokens, so a block is never
  re-quantized when it fills up, and a slot's value does not depend on its neighbours.
- qmax: 127 for int8 (symmetric, round to nearest), 448 for fp8 E4M3 (its largest finite).

A ``QuantizedKV`` stands in for one K or V cache tensor wherever the backends read a cache
by whole blocks: it has the cache's ``shape``, ``device`` and (storage) ``dtype``, and
``index_select(0, block_ids)`` returns the dequantized fp32 rows, so the CPU backend's block
gather reads it unchanged, in one pass (no fp32 copy of the cache ever exists); the fused
float32 C kernel declines it on dtype. Writes go through ``write_kv`` in base.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tokenmill.utils import hugepages

QUANT_KV_DTYPES = (torch.int8, torch.float8_e4m3fn)
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_SCALE_DTYPE = torch.float32
_TINY = torch.finfo(torch.float32).tiny   # scale floor: an all-zero row quantizes to zeros
_ROUNDER = 1.5 * 2.0**23


def is_quantized_kv_dtype(dtype: torch.dtype) -> bool:
    return dtype in QUANT_KV_DTYPES


def slot_bytes(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token takes in one K (or V) cache of one layer, scales included."""
    elem = torch.empty(0, dtype=dtype).element_size()
    scale = torch.empty(0, dtype=_SCALE_DTYPE).element_size() if is_quantized_kv_dtype(dtype) else 0
    return num_kv_heads * (head_dim * elem + scale)


def quantize_kv(x: torch.Tensor,   # [..., head_dim], any float dtype
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (values [..., D] in ``dtype``, scales [...] fp32), x ~= values * scales."""
    qmax = _QMAX[dtype]
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).div_(qmax).clamp_min_(_TINY)   # [..., 1]
    y = (x / scale).clamp_(-qmax, qmax)
    if dtype == torch.int8:
        # Round half to even by adding and removing 1.5 * 2**23 (exact for |y| < 2**22):
        # torch.round on a few thousand elements wakes the thread pool, milliseconds when
        # the cores are busy; two adds do not.
        y.add_(_ROUNDER).sub_(_ROUNDER)
    return y.to(dtype), scale.squeeze(-1)


def dequantize_kv(values: torch.Tensor,  # [..., D] int8 or float8_e4m3fn
                  scale: torch.Tensor,   # [...] fp32
                  ) -> torch.Tensor:     # [..., D] fp32
    if values.dtype == torch.int8:
        return values.float().mul_(scale[..., None])
    return _fp8_to_float_over_256(values).mul_(scale[..., None] * 256.0)


def _fp8_to_float_over_256(values: torch.Tensor) -> torch.Tensor:
    """E4M3 -> fp32, divided by 256, by moving the bits into an fp16 (~7x faster than
    ``.float()`` on CPU). E4M3 ``s eeee mmm`` placed as fp16 ``s 0eeee mmm0000000`` has the
    same exponent field and mantissa under a bias of 15 instead of 7: the value times 2**-8,
    exact for normals and subnormals alike. (NaN, which is never stored, would not survive.)"""
    bits = values.view(torch.int8).to(torch.int16)      # sign-extended
    bits = bits.bitwise_left_shift_(7).bitwise_and_(~(1 << 14))   # clear the sign copy in bit 14
    return bits.view(torch.float16).float()


def cache_zeros(shape: tuple, dtype: torch.dtype, device, huge_pages: bool = False) -> torch.Tensor:
    """A zero-filled KV cache tensor. On CPU from an anonymous memory map, whose pages the
    kernel hands out zeroed on first write: the pool costs resident memory only as blocks
    are used (a default 2 GB pool for a short chat is not 2 GB of RSS), and reading a slot
    never written gives zeros, as torch.zeros would. ``huge_pages``: a cache of 2 MB or more
    starts on a 2 MB boundary of a mapping advised to fault in 2 MB pages
    (utils/hugepages.py), so its resident memory grows 2 MB at a time."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    huge = huge_pages and nbytes >= hugepages.HUGE_PAGE
    # unmapped with the last tensor viewing it; the slack lets a huge-page cache start aligned
    pages = hugepages.anonymous_map(nbytes + (hugepages.HUGE_PAGE if huge else 0), huge)
    whole = torch.frombuffer(pages, dtype=torch.uint8)
    start = -whole.data_ptr() % hugepages.HUGE_PAGE if huge else 0
    return whole[start:start + nbytes].view(dtype).view(shape)


@dataclass
class QuantizedKV:
    """One layer's K (or V) cache, quantized.

    values: [num_blocks, block_size, num_kv_heads, head_dim] int8 or float8_e4m3fn
    scale:  [num_blocks, block_size, num_kv_heads] fp32
    """

    values: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def zeros(shape: tuple, dtype: torch.dtype, device, huge_pages: bool = False) -> "QuantizedKV":
        if not is_quantized_kv_dtype(dtype):
            raise ValueError(f"not a quantized KV dtype: {dtype}")
        return QuantizedKV(cache_zeros(shape, dtype, device, huge_pages),
                           cache_zeros(shape[:-1], _SCALE_DTYPE, device, huge_pages))

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype (int8 / float8_e4m3fn): kernels that take float caches decline."""
        return self.values.dtype

    def is_contiguous(self) -> bool:
        return self.values.is_contiguous() and self.scale.is_contiguous()

    @property
    def nbytes(self) -> int:
        return (self.values.numel() * self.values.element_size()
                + self.scale.numel() * self.scale.element_size())

    def index_select(self, dim: int, block_ids: torch.Tensor) -> torch.Tensor:
        """Whole blocks, dequantized: [len(block_ids), block_size, Hkv, D] fp32."""
        if dim != 0:
            raise ValueError("a quantized KV cache is read by whole blocks (dim 0)")
        return dequantize_kv(self.values.index_select(0, block_ids),
                             self.scale.index_select(0, block_ids))

    def read_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows of the cache viewed as [num_slots, Hkv, D], dequantized fp32."""
        return dequantize_kv(self.values.flatten(0, 1)[slots], self.scale.flatten(0, 1)[slots])

    def write(self, x: torch.Tensor,             # [T, num_kv_heads, head_dim]
              slot_mapping: torch.Tensor) -> None:  # [T] int64 flat slots
        self.store(*quantize_kv(x, self.values.dtype), slot_mapping)

    def store(self, q: torch.Tensor,             # [T, num_kv_heads, head_dim] quantized
              scale: torch.Tensor,               # [T, num_kv_heads] fp32
              slot_mapping: torch.Tensor) -> None:
        if not self.is_contiguous():
            raise ValueError("a quantized KV cache must be contiguous")
        # index_copy_ has no float8 kernel on CPU: copy the bytes (int8 bits) instead.
        self.values.view(torch.int8).flatten(0, 1).index_copy_(0, slot_mapping, q.view(torch.int8))
        self.scale.flatten(0, 1).index_copy_(0, slot_mapping, scale)


def write_quantized_kv(key: torch.Tensor,      # [T, num_kv_heads, head_dim]
                       value: torch.Tensor,    # [T, num_kv_heads, head_dim]
                       k_cache: QuantizedKV, v_cache: QuantizedKV,
                       slot_mapping: torch.Tensor) -> None:   # [T] int64 flat slots
    """Quantize K and V in one pass of small ops (per-op overhead dominates at decode)."""
    q, scale = quantize_kv(torch.stack((key, value)), k_cache.values.dtype)
    k_cache.store(q[0], scale[0], slot_mapping)
    v_cache.store(q[1], scale[1], slot_mapping)
