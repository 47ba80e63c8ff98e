from typing import Optional

import torch
from torch import nn

from tokenmill.layers import cpu_ops


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 like the HF reference."""

    cpu_kernels = True   # the fused C kernel where it applies (cpu_ops.set_cpu_kernels)
    triton_kernels = False   # the Triton kernel (CUDA backend; kernel_choice.set_triton_kernels)
    gemma = False        # x / rms(x) * (1 + weight), multiplied in float32 (GemmaRMSNorm)

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [..., hidden]
        if self.triton_kernels:
            return self._triton(x)
        fused = cpu_ops.rms_norm(x, self.weight, self.eps, gemma=self.gemma) if self._fused() else None
        if fused is not None:
            return fused
        return self._reference(x)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        var = x32.pow(2).mean(-1, keepdim=True)
        return (self.weight * (x32 * torch.rsqrt(var + self.eps))).to(x.dtype)

    def _triton(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        from tokenmill.layers import triton_ops
        rows = x.reshape(-1, x.shape[-1])
        if residual is None:
            return triton_ops.rms_norm(rows, self.weight, self.eps, gemma=self.gemma).view(x.shape)
        out, total = triton_ops.rms_norm(rows, self.weight, self.eps,
                                         residual=residual.reshape(rows.shape), gemma=self.gemma)
        return out.view(x.shape), total.view(x.shape)

    def _fused(self) -> bool:
        # the kernel computes these two (``gemma``); other subclasses compute differently
        return self.cpu_kernels and type(self) in (RMSNorm, GemmaRMSNorm)

    def add_and_norm(self, update: torch.Tensor, residual: torch.Tensor) -> tuple:
        """(norm(residual + update), residual + update). ``update`` is a fresh tensor the
        caller gives up: the fused CPU kernel writes the sum into it instead of allocating."""
        if self.triton_kernels:
            return self._triton(update, residual)
        fused: Optional[torch.Tensor] = None
        if self._fused():
            fused = cpu_ops.rms_norm(residual, self.weight, self.eps, residual=update, gemma=self.gemma)
        if fused is not None:
            return fused, update
        total = residual + update
        return self(total), total


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm stores ``weight - 1``: x / rms(x) * (1 + weight), all in float32
    (HF multiplies before casting back, unlike Llama)."""

    gemma = True

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight.data.zero_()

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)
