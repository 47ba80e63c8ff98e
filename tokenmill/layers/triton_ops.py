"""Fused elementwise kernels of the CUDA backend in Triton: RMSNorm (with the residual add),
gated activations and rotary embedding, each one pass over memory instead of several
PyTorch ops. Every kernel computes in fp32 and rounds once, like the module it stands in
for (norm.py, activation.py, rotary.py), which is its test oracle. Imported only when a
model runs with Triton kernels; on a CPU the kernels run in Triton's interpreter (tests).
Also the jit helpers the other Triton kernels share (``round_to``, ``dot_f32``).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

_BLOCK_COLS = 1024   # columns per program of the activation kernels


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even in ``dtype``, as torch rounds. Done by hand for
    bf16 because the interpreter truncates an fp32 -> bf16 cast (a GPU rounds): the bit
    trick gives the same answer in both, so interpreter tests are bit-exact."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = tl.where(x != x, 0x7FC00000, bits)   # NaN stays NaN (the add could make inf)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def dot_f32(a, b, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in fp32. UPCAST: operands widened to fp32 first, for Triton's
    interpreter, whose dot reads bf16 / fp16 operands as raw integers."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PREC)


# -- RMSNorm ----------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_res,
                     stride_out, stride_sum, n_cols, eps,
                     BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)   # row * stride can pass 2**31 on long prefills
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # torch adds residual + update in fp32 and rounds to the stream's dtype; the norm
        # then reads that rounded sum
        res = tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0).to(tl.float32)
        total = round_to(res + x, sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, total, mask=ok)
        x = total.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / n_cols + eps)   # IEEE sqrt, as torch.rsqrt
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if GEMMA:
        w = 1.0 + w        # Gemma stores weight - 1
    out = round_to(w * (x * inv_rms), out_ptr.dtype.element_ty)   # the module's product order
    tl.store(out_ptr + row * stride_out + cols, out, mask=ok)


def rms_norm(rows: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None, gemma: bool = False):
    """rows [M, N] (rows may be strided) -> norm(rows); with ``residual`` [M, N]:
    (norm(residual + rows), residual + rows), both new tensors. ``weight`` [N] may be fp32
    or the model dtype: the product is taken in fp32 either way, as in RMSNorm.forward."""
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    if residual is not None:
        if residual.shape != rows.shape or residual.dtype != rows.dtype:
            raise ValueError("rms_norm: residual must match rows in shape and dtype")
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    m, n = rows.shape
    out = torch.empty((m, n), dtype=rows.dtype, device=rows.device)
    total = torch.empty_like(out) if residual is not None else out
    if m:
        res = residual if residual is not None else rows   # unread without a residual
        _rms_norm_kernel[(m,)](rows, res, weight.contiguous(), out, total, rows.stride(0),
                               res.stride(0), out.stride(0), total.stride(0), n, eps,
                               BLOCK=triton.next_power_of_2(n),
                               HAS_RESIDUAL=residual is not None, GEMMA=gemma)
    return out if residual is None else (out, total)


# -- gated activations ------------------------------------------------------------------------
@triton.jit
def _gated_kernel(x_ptr, out_ptr, stride_x, stride_out, inter, BLOCK: tl.constexpr,
                  GELU_TANH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0).to(tl.float32)
    # act = gate * sigmoid(s): silu has s = gate; gelu-tanh has s = 2 * sqrt(2/pi) * (.), as
    # 0.5 * (1 + tanh(y)) == sigmoid(2y), which avoids 1 + tanh's cancellation near -1
    if GELU_TANH:
        s = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)
    else:
        s = gate
    # sigmoid from e = exp(-|s|) <= 1: exp never overflows (the interpreter would warn too)
    e = tl.exp(-tl.abs(s))
    act = gate * (tl.where(s >= 0, 1.0, e) / (1.0 + e))
    tl.store(out_ptr + row * stride_out + cols, round_to(act * up, out_ptr.dtype.element_ty),
             mask=ok)


def _gated(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    x = x if x.stride(-1) == 1 else x.contiguous()
    t, width = x.shape
    if width % 2:
        raise ValueError(f"gated activation needs an even last dim, got {width}")
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
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    # one program per (token, head): the q heads first, then the k heads
    if h < num_q_heads:
        ptr = q_ptr + t * stride_qt + h * stride_qh
    else:
        ptr = k_ptr + t * stride_kt + (h - num_q_heads) * stride_kh
    i = tl.arange(0, BLOCK)
    ok = i < HALF
    table = tl.load(pos_ptr + t).to(tl.int64) * stride_table
    x1 = tl.load(ptr + i, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF + i, mask=ok, other=0.0).to(tl.float32)
    # both table halves read as stored (they are equal for cat([freqs, freqs]) tables)
    cos1 = tl.load(cos_ptr + table + i, mask=ok, other=0.0)
    cos2 = tl.load(cos_ptr + table + HALF + i, mask=ok, other=0.0)
    sin1 = tl.load(sin_ptr + table + i, mask=ok, other=0.0)
    sin2 = tl.load(sin_ptr + table + HALF + i, mask=ok, other=0.0)
    out_ty = ptr.dtype.element_ty
    tl.store(ptr + i, round_to(x1 * cos1 - x2 * sin1, out_ty), mask=ok)
    tl.store(ptr + HALF + i, round_to(x2 * cos2 + x1 * sin2, out_ty), mask=ok)


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          positions: torch.Tensor) -> None:
    """Rotate-half RoPE in place: q [T, Hq, D], k [T, Hkv, D] (any token / head strides,
    unit last stride), tables cos / sin [P, R] fp32 (the first R <= D dims of each head
    rotate, R even), positions [T] (int, same device; not bounds-checked)."""
    t, num_q_heads, d = q.shape
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rope_ rotates in place: q and k need a unit last stride")
    if q.dtype != k.dtype or k.shape[0] != t or k.shape[2] != d:
        raise ValueError("rope_: q and k must agree in dtype, tokens and head size")
    rot = cos.shape[1]
    if rot % 2 or rot > d or sin.shape != cos.shape:
        raise ValueError(f"rope_: tables [P, {rot}] do not fit heads of {d}")
    if t == 0:
        return
    # the kernel indexes both tables with cos's row stride
    cos, sin = cos.contiguous(), sin.contiguous()
    _rope_kernel[(t, num_q_heads + k.shape[1])](
        q, k, cos, sin, positions, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), num_q_heads, HALF=rot // 2, BLOCK=triton.next_power_of_2(rot // 2))
