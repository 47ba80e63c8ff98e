"""GPTQ (Frantar et al. 2022) and plain RTN on the same integer grid.

Terms. H = 2/T * X^T X: the Hessian of the layer's squared output error w.r.t. one weight
row, from T calibration input rows X [T, K]. GPTQ quantizes one input column at a time and
spreads that column's rounding error over the not-yet-quantized columns through the inverse
Hessian (Cholesky form), so the layer's output, not its weights, stays close. Updates are
applied lazily per block of columns (one matmul per block instead of per column).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class IntQuant:
    """q [N, K] in 0..2^bits-1 (checkpoint column order), scale / zero [N, groups]
    (integer zero points; scales already rounded to fp16, as checkpoints store them),
    g_idx [K]: group of each input column."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    g_idx: torch.Tensor
    bits: int
    group_size: int

    def dequantize(self) -> torch.Tensor:
        g = self.g_idx.long()
        return (self.q.float() - self.zero[:, g]) * self.scale[:, g]


def grid_params(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Min/max grid of each row of w [N, G] -> scale [N], integer zero [N] (0 inside range)."""
    maxq = 2**bits - 1
    lo, hi = w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0)
    if sym:
        hi = torch.maximum(-lo, hi)
        lo = -hi
    scale = ((hi - lo) / maxq).clamp(min=1e-8).half().float()
    zero = torch.full_like(scale, (maxq + 1) // 2) if sym else torch.round(-lo / scale).clamp(0, maxq)
    return scale, zero


def _quant_col(w: torch.Tensor, scale, zero, maxq: int) -> torch.Tensor:
    return torch.clamp(torch.round(w / scale) + zero, 0, maxq)


def rtn(w: torch.Tensor, bits: int, group_size: int, sym: bool = False) -> IntQuant:
    """Round-to-nearest per group (group_size = K: per channel)."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)
    scale, zero = grid_params(groups.reshape(-1, group_size), bits, sym)
    scale, zero = scale.reshape(n, -1), zero.reshape(n, -1)
    q = _quant_col(groups, scale.unsqueeze(2), zero.unsqueeze(2), 2**bits - 1).reshape(n, k)
    return IntQuant(q.to(torch.uint8), scale, zero, torch.arange(k) // group_size, bits, group_size)


def gptq(w: torch.Tensor, h: torch.Tensor, bits: int, group_size: int, sym: bool = False,
         damp: float = 0.01, act_order: bool = False, static_groups: bool = False,
         block: int = 128) -> IntQuant:
    """w [N, K] float, h [K, K] -> IntQuant. ``act_order``: quantize columns by decreasing
    Hessian diagonal (salient inputs first); groups then follow that order (g_idx).
    ``static_groups``: every group's grid comes from the original weights before any update,
    so groups stay contiguous column ranges (g_idx = k // group_size, no input permutation
    at inference) even with act_order."""
    n, k = w.shape
    w, h = w.clone().float(), h.clone().float()
    dead = torch.diag(h) == 0              # inputs never active: weight irrelevant, pin it
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    if static_groups:
        grid = [grid_params(w[:, g0:g0 + group_size], bits, sym) for g0 in range(0, k, group_size)]
        static_scale = torch.stack([sc for sc, _ in grid], 1)
        static_zero = torch.stack([z for _, z in grid], 1)
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.diag(h).mean() * torch.eye(k)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    block = max(group_size, block // group_size * group_size)   # groups never straddle blocks
    q = torch.zeros(n, k)
    scales, zeros = [], []
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, hinv1 = w[:, i1:i2].clone(), hinv[i1:i2, i1:i2]
        err1 = torch.zeros_like(w1)
        for i in range(i2 - i1):
            if static_groups:
                col_group = int(perm[i1 + i]) // group_size
                scale, zero = static_scale[:, col_group], static_zero[:, col_group]
            elif (i1 + i) % group_size == 0:
                scale, zero = grid_params(w1[:, i:i + group_size], bits, sym)
                scales.append(scale)
                zeros.append(zero)
            q[:, i1 + i] = _quant_col(w1[:, i], scale, zero, 2**bits - 1)
            err = (w1[:, i] - (q[:, i1 + i] - zero) * scale) / hinv1[i, i]
            w1[:, i:] -= err.unsqueeze(1) * hinv1[i, i:].unsqueeze(0)
            err1[:, i] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    inv = torch.argsort(perm)
    if static_groups:
        return IntQuant(q[:, inv].to(torch.uint8), static_scale, static_zero,
                        torch.arange(k) // group_size, bits, group_size)
    g_idx = (torch.arange(k) // group_size)[inv]
    return IntQuant(q[:, inv].to(torch.uint8), torch.stack(scales, 1), torch.stack(zeros, 1),
                    g_idx, bits, group_size)


class HessianAccumulator:
    """Running H = 2/T * sum x x^T over calibration rows."""

    def __init__(self, k: int) -> None:
        self.h = torch.zeros(k, k)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:   # x [T, K]
        x = x.reshape(-1, x.shape[-1]).float()
        t = x.shape[0]
        self.h *= self.rows / (self.rows + t)
        self.rows += t
        x = x * (2.0 / self.rows) ** 0.5
        self.h += x.t() @ x

    def value(self) -> Optional[torch.Tensor]:
        return self.h if self.rows else None
