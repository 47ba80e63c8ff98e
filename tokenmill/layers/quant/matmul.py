"""y = x W^T for a packed weight: the compiled kernel where it applies, else the reference.

The kernel streams compressed weights and wins while the matmul is memory-bound (decode:
few rows). With many rows (prefill) the matmul is compute-bound and MKL's fp32 GEMM on a
freshly dequantized weight is faster; ``kernel_max_rows`` is that crossover, measured with
``python -m tokenmill.bench.quant kernels``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tokenmill.layers.quant import kernels
from tokenmill.layers.quant.formats import Packed, dequantize_stored

_KINDS = {"i8": kernels.KIND_I8, "i4": kernels.KIND_I4, "f8": kernels.KIND_F8}
_MIN_GROUP = {"i8": 32, "f8": 32, "i4": 32}   # the kernel steps 32 values at a time

DEFAULT_KERNEL_MAX_ROWS = 16


def kernel_applies(p: Packed) -> bool:
    g = p.group_size
    return (kernels.available() and g % _MIN_GROUP[p.kind] == 0 and p.in_features % g == 0
            and p.qweight.device.type == "cpu" and p.qweight.is_contiguous()
            and p.scales.is_contiguous() and (p.mins is None or p.mins.is_contiguous()))


def reference_linear(x: torch.Tensor, p: Packed, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The oracle: dequantize to float32, then a plain F.linear.   x [..., K] -> [..., N]"""
    from tokenmill.layers.quant.formats import dequantize
    return F.linear(x.float(), dequantize(p), None if bias is None else bias.float())


def packed_linear(x: torch.Tensor, p: Packed, bias: Optional[torch.Tensor] = None,
                  use_kernel: bool = True,
                  kernel_max_rows: int = DEFAULT_KERNEL_MAX_ROWS) -> torch.Tensor:
    """x [..., K] -> [..., N] float32 (activations stay float32: no activation quantization)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, p.in_features).float()
    if p.perm is not None:
        x2 = x2.index_select(1, p.perm)
    if p.kernel_ok is None:
        p.kernel_ok = kernel_applies(p)
    if use_kernel and x2.shape[0] <= kernel_max_rows and p.kernel_ok:
        y = kernels.qmm(x2.contiguous(), _KINDS[p.kind], p.qweight, p.scales, p.mins,
                        p.group_size, p.out_features)
    elif use_kernel and p.kernel_ok:
        y = F.linear(x2, kernels.dequant(_KINDS[p.kind], p.qweight, p.scales, p.mins,
                                         p.group_size, p.out_features, p.in_features))
    else:
        y = F.linear(x2, dequantize_stored(p))
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, p.out_features)
