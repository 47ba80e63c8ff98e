"""Gated activations for fused [T, 2 * inter] gate_up projections: act(gate) * up."""
import torch
from torch import nn

from tokenmill.layers import cpu_ops


class SiluAndMul(nn.Module):
    """silu(gate) * up (Llama, Mistral, Qwen)."""

    cpu_kernels = True   # the fused C kernel where it applies (cpu_ops.set_cpu_kernels)
    triton_kernels = False   # the Triton kernel (CUDA backend; kernel_choice.set_triton_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [T, 2*inter] -> [T, inter]
        if self.triton_kernels:
            from tokenmill.layers import triton_ops
            return triton_ops.silu_mul(x)
        fused = cpu_ops.silu_mul(x) if self.cpu_kernels else None
        if fused is not None:
            return fused
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(gate) * up (Gemma's ``gelu_pytorch_tanh``)."""

    cpu_kernels = True   # the fused C kernel where it applies (cpu_ops.set_cpu_kernels)
    triton_kernels = False   # the Triton kernel (CUDA backend; kernel_choice.set_triton_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [T, 2*inter] -> [T, inter]
        if self.triton_kernels:
            from tokenmill.layers import triton_ops
            return triton_ops.gelu_tanh_mul(x)
        fused = cpu_ops.gelu_tanh_mul(x) if self.cpu_kernels else None
        if fused is not None:
            return fused
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.gelu(gate, approximate="tanh") * up


class GeluAndMul(nn.Module):
    """exact gelu(gate) * up (``gelu``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [T, 2*inter] -> [T, inter]
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.gelu(gate) * up


_GATED = {
    "silu": SiluAndMul, "swish": SiluAndMul,
    "gelu_pytorch_tanh": GeluTanhAndMul, "gelu_tanh": GeluTanhAndMul, "gelu_new": GeluTanhAndMul,
    "gelu": GeluAndMul,
}


def gated_activation(name: str) -> nn.Module:
    """The act(gate) * up module for an HF ``hidden_act`` name; unknown names fail loudly."""
    try:
        return _GATED[name]()
    except KeyError:
        raise ValueError(f"activation {name!r} is not supported (supported: {', '.join(sorted(_GATED))})") from None
