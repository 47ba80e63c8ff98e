"""Packed-weight matmuls of the CUDA backend: y = x W^T with W kept int8 / int4 / fp8 in
memory (formats.py) and dequantized tile by tile in registers, and FP8 weights through
``torch._scaled_mm`` where the GPU has FP8 tensor cores (compute capability 8.9+: Ada,
Hopper). The oracle is matmul.reference_linear (dequantize, then a float32 matmul).

Imported only when a model runs with Triton kernels; on a CPU the kernel runs in Triton's
interpreter (the tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.quant.formats import FP8_MAX, Packed
from tokenmill.layers.triton_ops import dot_f32

_KIND_CODES = {"i8": 0, "i4": 1, "f8": 2}
_FP8 = torch.float8_e4m3fn
_MIN_FP8_SCALE = 1e-12


@triton.jit
def _e4m3_to_f32(raw):
    """E4M3 bytes to fp32 from their bits, for GPUs without the fp8 type (before sm_89):
    sign, 4-bit exponent (bias 7), 3-bit mantissa; exponent 0 is subnormal. Every step is
    exact in fp32. NaN (0x7f / 0xff) is never stored (quantizers clamp to +-448)."""
    b = raw.to(tl.int32)
    e = (b >> 3) & 0xF
    m = b & 0x7
    mant = tl.where(e == 0, m, m + 8).to(tl.float32)   # normal numbers' implicit leading 1
    pow2 = ((tl.maximum(e, 1) + 117) << 23).to(tl.float32, bitcast=True)   # 2^(max(e,1)-10)
    mag = mant * pow2
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def _weight_tile(w_ptr, s_ptr, mins_ptr, rn, k0, rk, n_ok, k_ok, stride_wn, stride_sn,
                 GROUP: tl.constexpr, KIND: tl.constexpr, HAS_MINS: tl.constexpr,
                 FP8_NATIVE: tl.constexpr):
    """W[rn, rk] dequantized to fp32, [BLOCK_N, BLOCK_K]; the tile lies in one group."""
    mask = n_ok[:, None] & k_ok[None, :]
    if KIND == 1:
        # int4, two per byte: in each run of 32 values byte j holds j (low) and j + 16 (high)
        byte = (rk // 32) * 16 + rk % 16
        packed = tl.load(w_ptr + rn[:, None] * stride_wn + byte[None, :], mask=mask, other=0)
        q = ((packed.to(tl.int32) >> (4 * ((rk % 32) // 16))[None, :]) & 0xF).to(tl.float32)
    elif KIND == 2:
        raw = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=mask, other=0)
        if FP8_NATIVE:
            q = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            q = _e4m3_to_f32(raw)
    else:
        q = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=mask,
                    other=0).to(tl.float32)
    group = k0 // GROUP
    w = q * tl.load(s_ptr + rn * stride_sn + group, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    if HAS_MINS:
        w += tl.load(mins_ptr + rn * stride_sn + group, mask=n_ok,
                     other=0.0).to(tl.float32)[:, None]
    return w


@triton.jit
def _packed_gemm_kernel(x_ptr, w_ptr, s_ptr, mins_ptr, out_ptr, M, N, stride_xm, stride_wn,
                        stride_sn, stride_om, K: tl.constexpr, GROUP: tl.constexpr,
                        KIND: tl.constexpr, HAS_MINS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
                        FP8_NATIVE: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    # int64 row offsets: rows x strides pass 2^31 (a 256k-vocab head's N x K, many-token M x N)
    rm, rn = rm.to(tl.int64), rn.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):   # K is a constexpr: a loop the compiler can pipeline
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = _weight_tile(w_ptr, s_ptr, mins_ptr, rn, k0, rk, n_ok, k_ok, stride_wn, stride_sn,
                         GROUP, KIND, HAS_MINS, FP8_NATIVE).to(x.dtype)
        acc += dot_f32(x, tl.trans(w), DOT_PREC, UPCAST)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc,
             mask=m_ok[:, None] & n_ok[None, :])


def _block_k(p: Packed) -> int:
    """A K tile within one group: any size when the whole row is one group, else a power
    of two (>= 16, tl.dot's least) dividing the group."""
    if p.group_size == p.in_features:
        return 64 if p.in_features >= 64 else max(16, triton.next_power_of_2(p.in_features))
    for block in (64, 32, 16):
        if p.group_size % block == 0:
            return block
    raise ValueError(f"group size {p.group_size} has no Triton K tile (needs a multiple of 16)")


def packed_linear_triton(x2: torch.Tensor, p: Packed) -> torch.Tensor:
    """x2 [M, K] (fp32 / bf16 / fp16, columns already in stored order) -> [M, N] fp32."""
    m, k = x2.shape
    if k != p.in_features:
        raise ValueError(f"x has {k} features, the weight {p.in_features}")
    x2 = x2.contiguous()
    out = torch.empty((m, p.out_features), dtype=torch.float32, device=x2.device)
    if m == 0:
        return out
    block_m = 16 if m <= 16 else 64
    mins = p.mins if p.mins is not None else p.scales
    grid = (triton.cdiv(m, block_m), triton.cdiv(p.out_features, 64))
    _packed_gemm_kernel[grid](
        x2, p.qweight, p.scales, mins, out, m, p.out_features, x2.stride(0),
        p.qweight.stride(0), p.scales.stride(0), out.stride(0),
        K=k, GROUP=p.group_size, KIND=_KIND_CODES[p.kind], HAS_MINS=p.mins is not None,
        BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=_block_k(p),
        DOT_PREC="ieee" if x2.dtype == torch.float32 else "tf32",
        UPCAST=x2.device.type != "cuda", FP8_NATIVE=_fp8_native(x2.device))
    return out


def _fp8_native(device: torch.device) -> bool:
    """Whether Triton has the e4m3 type there: sm_89+ GPUs, and the interpreter."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_scaled_mm_applies(x2: torch.Tensor, p: Packed) -> bool:
    """FP8 tensor cores: an fp8 weight with one scale per output row, 16-aligned shapes,
    half-precision activations, on a GPU of compute capability 8.9 or newer."""
    return (p.kind == "f8" and p.group_size == p.in_features and x2.is_cuda
            and x2.dtype in (torch.bfloat16, torch.float16)
            and p.in_features % 16 == 0 and p.out_features % 16 == 0
            and torch.cuda.get_device_capability(x2.device) >= (8, 9))


def fp8_linear(x2: torch.Tensor, p: Packed) -> torch.Tensor:
    """x2 [M, K] -> [M, N] in x2's dtype: activations quantized to E4M3 per row (dynamic
    scale amax / 448), one FP8 GEMM with the row and column scales applied in its epilogue."""
    x2 = x2.contiguous()   # _scaled_mm's first operand must be row-major (so xq is too)
    x_scale = (x2.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=_MIN_FP8_SCALE)
    xq = (x2.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(_FP8)
    w = p.qweight.view(_FP8)   # [N, K] row-major: its transpose is the column-major operand
    return torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=p.scales.float().view(1, -1),
                            out_dtype=x2.dtype)


def triton_packed_linear(x: torch.Tensor, p: Packed) -> torch.Tensor:
    """x [..., K] -> [..., N] float32: FP8 tensor cores where they apply, else the Triton
    GEMM over the packed weight."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, p.in_features)
    if p.perm is not None:
        x2 = x2.index_select(1, p.perm)
    if fp8_scaled_mm_applies(x2, p):
        y = fp8_linear(x2, p).float()
    else:
        y = packed_linear_triton(x2, p)
    return y.reshape(*lead, p.out_features)
