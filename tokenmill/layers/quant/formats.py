"""Packed weight formats, their plain-PyTorch dequantization (the test oracle of every fast
path) and round-to-nearest (RTN) quantizers.

Terms. ``group_size`` G: consecutive input columns that share one scale (G = K is
per-channel). INT4 is affine: w = scale * q + min with q in 0..15 and min = -zero * scale for
an integer zero point (the GPTQ / AWQ convention); INT8 and FP8 are symmetric: w = scale * q.
INT4 nibbles are stored two per byte in the GGUF Q4 layout: within each run of 32 values,
byte j holds value j (low nibble) and value j + 16 (high nibble).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

FP8_MAX = 448.0   # largest finite float8_e4m3fn


@dataclass
class Packed:
    """One quantized [N, K] weight ready for the matmul. ``kind`` is "i8", "i4" or "f8";
    ``qweight``: int8 [N, K] (i8), uint8 [N, K/2] (i4), uint8 bytes of e4m3 [N, K] (f8);
    ``scales`` / ``mins``: float32 [N, K/G], or float16 for i8 / i4 when they are a
    checkpoint's own fp16 values (GGUF blocks: half the bytes, exact); ``perm``: optional int64 [K] input-column order
    (GPTQ act-order: columns are stored sorted by group)."""

    kind: str
    qweight: Optional[torch.Tensor]    # None once the tiled copy is the only one (stored())
    scales: torch.Tensor
    mins: Optional[torch.Tensor]
    group_size: int
    out_features: int
    in_features: int
    perm: Optional[torch.Tensor] = None
    kernel_ok: Optional[bool] = None   # cached by matmul.packed_linear (shapes never change)
    tiled: Optional[object] = None     # qgemm.Tiled: the q8 GEMM's copy, made at load (qgemm.py)

    def stored(self, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``qweight`` (its ``rows``, int64 ids, when given), read back from the tiled copy
        when that is the only copy (qgemm.tile_packed_linears)."""
        if self.qweight is not None:
            return self.qweight if rows is None else self.qweight.index_select(0, rows)
        if self.tiled is None:
            raise ValueError("a packed weight without values: neither qweight nor a tiled copy")
        if rows is None:
            rows = torch.arange(self.out_features)
        return self.tiled.stored_rows(rows)

    def tensors(self) -> dict[str, torch.Tensor]:
        if self.qweight is None:
            raise ValueError("a packed weight that lives only in its tiled copy has no tensors to register")
        named = {"qweight": self.qweight, "scales": self.scales}
        if self.mins is not None:
            named["mins"] = self.mins
        if self.perm is not None:
            named["perm"] = self.perm
        return named


def pick_group_size(in_features: int, wanted: int) -> int:
    """The wanted group if it divides K, else the largest of 128/64/32 below it that does;
    K itself (per-channel) when none fits."""
    for g in (wanted, 128, 64, 32):
        if g <= wanted and g > 0 and in_features % g == 0:
            return g
    return in_features


# -- int4 nibble packing --------------------------------------------------------------------
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 (K % 32 == 0) -> [N, K/2] uint8 in the GGUF Q4 layout."""
    n, k = q.shape
    blocks = q.to(torch.uint8).reshape(n, k // 32, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 -> [N, K] uint8 values 0..15."""
    n, half = packed.shape
    blocks = packed.reshape(n, half // 16, 1, 16)
    return torch.cat([blocks & 0x0F, blocks >> 4], dim=2).reshape(n, half * 2)


# -- reference dequantization ---------------------------------------------------------------
def _expand(groups: torch.Tensor, group_size: int) -> torch.Tensor:   # [N, K/G] -> [N, K]
    return groups.repeat_interleave(group_size, dim=1)


def dequantize(p: Packed) -> torch.Tensor:
    """float32 [N, K] in the checkpoint's column order (act-order permutation undone)."""
    w = dequantize_stored(p)
    return w[:, torch.argsort(p.perm)] if p.perm is not None else w


def dequantize_stored(p: Packed) -> torch.Tensor:
    """float32 [N, K] in stored column order (``perm`` applied to the columns)."""
    stored = p.stored()
    if p.kind == "i8":
        values = stored.float()
    elif p.kind == "f8":
        values = stored.view(torch.float8_e4m3fn).float()
    elif p.kind == "i4":
        values = unpack_int4(stored).float()
    else:
        raise ValueError(f"unknown packed kind {p.kind!r}")
    n, k = values.shape
    groups = values.view(n, k // p.group_size, p.group_size)   # broadcast, no repeat copies
    w = groups * p.scales.float().unsqueeze(2)
    if p.mins is not None:
        w += p.mins.float().unsqueeze(2)
    return w.view(n, k)


# -- RTN quantizers ---------------------------------------------------------------------------
def row_absmax(w: torch.Tensor) -> torch.Tensor:
    """max |w| of each row, [N, 1] (a row-parallel rank reduces it over the ranks)."""
    return w.float().abs().amax(dim=1, keepdim=True)


def quantize_int8(w: torch.Tensor, absmax: Optional[torch.Tensor] = None) -> Packed:
    """Per-channel symmetric: scale = max|w_row| / 127 (``absmax``: of the whole row when
    ``w`` holds only some of its columns)."""
    w = w.float()
    absmax = row_absmax(w) if absmax is None else absmax
    scale = (absmax / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    n, k = w.shape
    return Packed("i8", q, scale.contiguous(), None, k, n, k)


def int4_params(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric min/max grid per group: scales [N, K/G], integer zero points [N, K/G]."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    lo = g.amin(dim=2).clamp(max=0.0)   # the grid always contains 0, as GPTQ's does
    hi = g.amax(dim=2).clamp(min=0.0)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)
    zero = torch.round(-lo / scale).clamp(0, 15)
    return scale, zero


def quantize_int4_with(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                       group_size: int) -> torch.Tensor:
    """q = clamp(round(w / scale) + zero, 0, 15) as uint8 [N, K]."""
    n, k = w.shape
    s, z = _expand(scale, group_size), _expand(zero, group_size)
    return torch.clamp(torch.round(w.float() / s) + z, 0, 15).to(torch.uint8).reshape(n, k)


def quantize_int4(w: torch.Tensor, group_size: int) -> Packed:
    n, k = w.shape
    scale, zero = int4_params(w, group_size)
    q = quantize_int4_with(w, scale, zero, group_size)
    return int4_packed(q, scale, zero, group_size)


def int4_packed(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                perm: Optional[torch.Tensor] = None) -> Packed:
    """q [N, K] 0..15 with (scale, integer zero) per group -> the kernel's (scale, min) form."""
    n, k = q.shape
    mins = (-zero.float() * scale.float()).contiguous()
    return Packed("i4", pack_int4(q), scale.float().contiguous(), mins, group_size, n, k, perm)


def quantize_fp8(w: torch.Tensor, absmax: Optional[torch.Tensor] = None) -> Packed:
    """Per-channel E4M3: scale = max|w_row| / 448, values rounded to the nearest e4m3."""
    w = w.float()
    absmax = row_absmax(w) if absmax is None else absmax
    scale = (absmax / FP8_MAX).clamp(min=1e-12)
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    n, k = w.shape
    return Packed("f8", q, scale.contiguous(), None, k, n, k)
