"""Fused elementwise kernels of the CUDA backend in Triton: RMSNorm (with the residual add),
gated activations and rotary embedding, each one pass over memory instead of several
PyTorch ops. Every kernel computes in fp32 and rounds once, like the module it stands in
for (norm.py, activation.py, rotary.py), which is its test oracle. Imported only when a
model runs with Triton kernels; on a CPU the kernels run in Triton's interpreter (tests).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

_BLOCK_COLS = 1024   # columns per program of the activation kernels


# -- RMSNorm ----------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_res,
                     stride_out, stride_sum, n_cols, eps,
                     BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        # residual + update added in fp32 and rounded to the stream's dtype, as torch adds
        res = tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0)
        x = (res.to(tl.float32) + x.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=ok)
    x = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if GEMMA:
        w = 1.0 + w        # Gemma stores weight - 1
    tl.store(out_ptr + row * stride_out + cols, (w * (x * inv_rms)).to(out_ptr.dtype.element_ty),
             mask=ok)


def rms_norm(rows: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None, gemma: bool = False):
    """rows [M, N] (unit column stride) -> norm(rows); with ``residual`` [M, N]:
    (norm(residual + rows), residual + rows), both new tensors."""
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, n = rows.shape
    out = torch.empty((m, n), dtype=rows.dtype, device=rows.device)
    total = torch.empty_like(out) if residual is not None else out
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    if m:
        res = residual if residual is not None else rows
        _rms_norm_kernel[(m,)](rows, res, weight, out, total, rows.stride(0), res.stride(0),
                               out.stride(0), total.stride(0), n, eps,
                               BLOCK=triton.next_power_of_2(n),
                               HAS_RESIDUAL=residual is not None, GEMMA=gemma)
    return out if residual is None else (out, total)


# -- gated activations ------------------------------------------------------------------------
@triton.jit
def _gated_kernel(x_ptr, out_ptr, stride_x, stride_out, inter, BLOCK: tl.constexpr,
                  GELU_TANH: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0).to(tl.float32)
    if GELU_TANH:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        inner = tl.minimum(tl.maximum(inner, -20.0), 20.0)   # tanh is +-1 in fp32 beyond
        # tanh(y) = 1 - 2 / (exp(2y) + 1): the same formula compiled and interpreted
        act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty),
             mask=ok)


def _gated(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, width = x.shape
    inter = width // 2
    out = torch.empty((t, inter), dtype=x.dtype, device=x.device)
    if t and inter:
        block = min(_BLOCK_COLS, triton.next_power_of_2(inter))
        _gated_kernel[(t, triton.cdiv(inter, block))](x, out, x.stride(0), out.stride(0), inter,
                                                     BLOCK=block, GELU_TANH=gelu_tanh)
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] -> silu(gate) * up, [T, I]."""
    return _gated(x, gelu_tanh=False)


def gelu_tanh_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] -> gelu_tanh(gate) * up, [T, I]."""
    return _gated(x, gelu_tanh=True)


# -- rotary embedding -------------------------------------------------------------------------
@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, stride_qt, stride_qh, stride_kt,
                 stride_kh, stride_table, num_q_heads, HALF: tl.constexpr,
                 BLOCK: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    if h < num_q_heads:
        ptr = q_ptr + t * stride_qt + h * stride_qh
    else:
        ptr = k_ptr + t * stride_kt + (h - num_q_heads) * stride_kh
    i = tl.arange(0, BLOCK)
    ok = i < HALF
    pos = tl.load(pos_ptr + t)
    table = pos * stride_table
    x1 = tl.load(ptr + i, mask=ok, other=0.0)
    x2 = tl.load(ptr + HALF + i, mask=ok, other=0.0)
    out_ty = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    cos1 = tl.load(cos_ptr + table + i, mask=ok, other=0.0)
    cos2 = tl.load(cos_ptr + table + HALF + i, mask=ok, other=0.0)
    sin1 = tl.load(sin_ptr + table + i, mask=ok, other=0.0)
    sin2 = tl.load(sin_ptr + table + HALF + i, mask=ok, other=0.0)
    tl.store(ptr + i, (x1 * cos1 - x2 * sin1).to(out_ty), mask=ok)
    tl.store(ptr + HALF + i, (x2 * cos2 + x1 * sin2).to(out_ty), mask=ok)


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          positions: torch.Tensor) -> None:
    """Rotate-half RoPE in place: q [T, Hq, D], k [T, Hkv, D] (unit last stride), tables
    cos / sin [P, R] (R <= D rotated dims, fp32), positions [T] on the same device."""
    t, num_q_heads, _ = q.shape
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rope_ rotates in place: q and k need a unit last stride")
    if t == 0:
        return
    half = cos.shape[1] // 2
    _rope_kernel[(t, num_q_heads + k.shape[1])](
        q, k, cos, sin, positions, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), num_q_heads, HALF=half, BLOCK=triton.next_power_of_2(half))
