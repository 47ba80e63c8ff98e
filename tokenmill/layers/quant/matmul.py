"""y = x W^T for a packed weight: the compiled kernel where it applies, else the reference.

The kernel streams compressed weights and wins while the matmul is memory-bound (decode:
few rows). With many rows (prefill) the matmul is compute-bound and MKL's fp32 GEMM on a
freshly dequantized weight is faster; ``kernel_max_rows`` is that crossover, measured with
``python -m tokenmill.bench.quant kernels``. With q8 activations, a weight tiled at load
(qgemm.py) takes the tiled integer GEMM at every row count instead (with AVX-512 VNNI:
1.9-3x the fp32 GEMM's rate at many rows, 2-4x the streaming kernel's at one row).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
import torch.nn.functional as F

from tokenmill.layers import cpu_ops
from tokenmill.layers.quant import kernels, qgemm
from tokenmill.layers.quant.formats import Packed, dequantize_stored

_KINDS = {"i8": kernels.KIND_I8, "i4": kernels.KIND_I4, "f8": kernels.KIND_F8}
_MIN_GROUP = {"i8": 32, "f8": 32, "i4": 32}   # the kernel steps 32 values at a time

DEFAULT_KERNEL_MAX_ROWS = 16

# How the kernel treats activations for int8 / int4 weights: "fp32" (default) keeps them
# float32 (faithful to dequantize-then-matmul up to summation order); "q8" rounds each run of
# 32 activations to int8 for integer dot products (the scheme llama.cpp uses): 1.8x (int8)
# to 2.6x (int4) the kernel's compute rate, at a measured accuracy cost on SmolLM2-135M
# (decode-path perplexity +0.17% for int8, +2.0% for int4-g32), so it is opt-in.
# The mode is each linear strategy's own (PackedLinearMethod.activations, from
# ModelConfig.quant_activations), so two models in one process may differ.
ACTIVATION_MODES = ("fp32", "q8")


def quantize_activations_q8(x: torch.Tensor) -> torch.Tensor:
    """The reference of the q8 activation path: x [M, K] rounded to int8 per run of 32 with
    scale max|x| / 127, returned dequantized (float32)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // 32, 32)
    d = blocks.abs().amax(dim=2, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv) * d).reshape(m, k)


def kernel_applies(p: Packed) -> bool:
    g = p.group_size
    # float32 scales / mins, or float16 ones for int8 / int4 (KIND_HALF); both of one dtype
    if p.scales.dtype not in (torch.float32, torch.float16) or (
            p.mins is not None and p.mins.dtype is not p.scales.dtype):
        return False
    if p.scales.dtype is torch.float16 and p.kind not in ("i8", "i4"):
        return False
    # groups step 32 values at a time; int8 may also have 16 (GGUF Q6_K's scales)
    group_ok = g % _MIN_GROUP[p.kind] == 0 or (
        p.kind == "i8" and g == 16 and p.mins is None and p.in_features % 32 == 0)
    values_ok = p.qweight is None or (p.qweight.device.type == "cpu" and p.qweight.is_contiguous())
    return (kernels.available() and group_ok and p.in_features % g == 0 and values_ok
            and p.scales.device.type == "cpu"
            and p.scales.is_contiguous() and (p.mins is None or p.mins.is_contiguous()))


def reference_linear(x: torch.Tensor, p: Packed, bias: Optional[torch.Tensor] = None,
                     activations: str = "fp32") -> torch.Tensor:
    """The oracle: dequantize to float32, then a plain F.linear.   x [..., K] -> [..., N]
    ``activations="q8"``: what the q8 kernel computes for int8 / int4 weights (x quantized
    per run of 32 in stored column order first; int4's min term on the float x)."""
    from tokenmill.layers.quant.formats import dequantize
    b = None if bias is None else bias.float()
    if activations == "q8" and p.kind in ("i8", "i4"):
        x2 = x.reshape(-1, p.in_features).float()
        if p.perm is not None:
            x2 = x2.index_select(1, p.perm)
        # int4's affine term min * sum(x) uses the exact float sums of x, like the kernel
        y = F.linear(quantize_activations_q8(x2), dequantize_stored(replace(p, mins=None)), b)
        if p.mins is not None:
            y = y + F.linear(x2, p.mins.float().repeat_interleave(p.group_size, dim=1))
        return y.reshape(*x.shape[:-1], p.out_features)
    return F.linear(x.float(), dequantize(p), b)


def _dequant_gemm(x2: torch.Tensor, p: Packed) -> torch.Tensor:
    """Many rows: dequantize W a slice of output rows at a time (the float32 slice stays in
    cache instead of a whole fp32 W going through memory: SmolLM2's int8 head is 113 MB as
    float32) and multiply each slice with MKL (cpu_ops.GEMM_N_SLICE: MKL's fast shape)."""
    def rows(n0: int, n1: int) -> torch.Tensor:
        values = p.qweight[n0:n1] if p.qweight is not None else p.stored(torch.arange(n0, n1))
        return kernels.dequant(_KINDS[p.kind], values, p.scales[n0:n1],
                               p.mins[n0:n1] if p.mins is not None else None, p.group_size,
                               n1 - n0, p.in_features)
    return cpu_ops.linear_by_row_slices(x2, p.out_features, rows)


def packed_linear(x: torch.Tensor, p: Packed, bias: Optional[torch.Tensor] = None,
                  use_kernel: bool = True,
                  kernel_max_rows: int = DEFAULT_KERNEL_MAX_ROWS,
                  activations: str = "fp32") -> torch.Tensor:
    """x [..., K] -> [..., N] float32. int8 / int4 weights with q8 activations
    (``activations``: "fp32" or "q8") and a tiled copy: the tiled q8 GEMM at any
    row count. Else few rows: the streaming kernel (q8 or float activations); many rows:
    dequantize + fp32 GEMM."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, p.in_features).float()
    if p.perm is not None:
        x2 = x2.index_select(1, p.perm)
    if p.kernel_ok is None:
        p.kernel_ok = kernel_applies(p)
    q8 = activations == "q8" and p.kind in ("i8", "i4")
    if use_kernel and q8 and p.tiled is not None:   # any row count (qgemm.py)
        y = qgemm.qgemm_q8(x2.contiguous(), p.tiled)
    elif use_kernel and x2.shape[0] <= kernel_max_rows and p.kernel_ok:
        # (a weight kept only tiled reaches here only with float activations: read back)
        qmm = kernels.qmm_q8 if q8 else kernels.qmm
        y = qmm(x2.contiguous(), _KINDS[p.kind], p.stored(), p.scales, p.mins, p.group_size,
                p.out_features)
    elif use_kernel and p.kernel_ok:
        y = _dequant_gemm(x2, p)
    else:
        y = F.linear(x2, dequantize_stored(p))
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, p.out_features)
