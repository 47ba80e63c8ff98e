"""The quantized matmuls of the kernel library (qmm.c, qgemm.c; built by layers/native.py)
called through ctypes. Where the library cannot run here ``available()`` is False and
callers use the plain-PyTorch reference instead.
"""
from __future__ import annotations

from typing import Optional

import torch

from tokenmill.layers import native

KIND_I8, KIND_I4, KIND_F8 = 0, 1, 2
KIND_I5 = 3      # tiled copies only (qgemm.py): int8 values of five bits (GGUF Q5_0 / Q5_1 / Q5_K)
KIND_HALF = 8   # flag (i8 / i4): scales and mins are float16


def kind_code(kind: int, scales: torch.Tensor) -> int:
    """The C kind of a weight whose scales have this dtype."""
    return kind | KIND_HALF if scales.dtype is torch.float16 else kind


def available() -> bool:
    return native.library() is not None


def qmm(x: torch.Tensor, kind: int, w: torch.Tensor, scales: torch.Tensor,
        mins: Optional[torch.Tensor], group_size: int, n: int) -> torch.Tensor:
    """x [M, K] float32 contiguous -> [M, N]; w [N, K] int8/uint8 or [N, K/2] uint8;
    scales / mins [N, K/group_size] float32 (or float16, i8 / i4), contiguous. The caller
    checks availability."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32)
    native.library().tm_qmm(x.data_ptr(), m, k, w.data_ptr(), scales.data_ptr(),
                mins.data_ptr() if mins is not None else None, group_size, n, kind_code(kind, scales),
                y.data_ptr(), torch.get_num_threads())
    return y


def qmm_q8(x: torch.Tensor, kind: int, w: torch.Tensor, scales: torch.Tensor,
           mins: Optional[torch.Tensor], group_size: int, n: int) -> torch.Tensor:
    """Like ``qmm`` with x quantized to int8 per run of 32 values first (integer dot
    products); kinds KIND_I8 / KIND_I4 only, K and group_size multiples of 32."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32)
    if native.library().tm_qmm_q8(x.data_ptr(), m, k, w.data_ptr(), scales.data_ptr(),
                      mins.data_ptr() if mins is not None else None, group_size, n,
                      kind_code(kind, scales),
                      y.data_ptr(), torch.get_num_threads()):
        raise MemoryError("quantized matmul could not allocate its activation buffer")
    return y


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 contiguous (K % 32 == 0) -> (int8 [M, K], scales [M, K/32]) as the
    kernel computes them (for tests)."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // 32, dtype=torch.float32)
    native.library().tm_quantize_q8(x.data_ptr(), m, k, q.data_ptr(), d.data_ptr())
    return q, d


def dequant(kind: int, w: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor],
            group_size: int, n: int, k: int) -> torch.Tensor:
    """float32 [N, K] in stored column order (same contract as ``qmm``)."""
    out = torch.empty(n, k, dtype=torch.float32)
    native.library().tm_dequant(w.data_ptr(), scales.data_ptr(), mins.data_ptr() if mins is not None else None,
                    group_size, n, k, kind_code(kind, scales), out.data_ptr(), torch.get_num_threads())
    return out
