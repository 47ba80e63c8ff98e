"""Which fused kernels a loaded model's modules use, set once after loading (never a global
switch): the C kernels on CPU (cpu_ops.set_cpu_kernels) or the Triton kernels of the CUDA
backend (set_triton_kernels), each an attribute of the module or strategy that owns it."""
from __future__ import annotations

import torch


def set_triton_kernels(model: torch.nn.Module, enabled: bool) -> None:
    """Every module, and every linear strategy, with a ``triton_kernels`` attribute gets
    ``enabled``; where Triton runs, the C kernels step aside."""
    for module in model.modules():
        for owner in (module, getattr(module, "quant_method", None)):
            if owner is not None and hasattr(owner, "triton_kernels"):
                owner.triton_kernels = bool(enabled)
                if enabled and hasattr(owner, "cpu_kernels"):
                    owner.cpu_kernels = False
