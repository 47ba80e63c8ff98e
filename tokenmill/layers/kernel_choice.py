"""Which fused kernels a loaded model's modules use, set once after loading (never a global
switch): the C kernels on CPU (``cpu_kernels``) or the Triton kernels (``triton_kernels``),
each an attribute of the module or linear strategy that owns it."""
from __future__ import annotations

import torch


def set_kernel_flag(model: torch.nn.Module, flag: str, enabled: bool) -> None:
    """Every module, and every linear strategy, that has attribute ``flag`` gets ``enabled``."""
    for module in model.modules():
        for owner in (module, getattr(module, "quant_method", None)):
            if owner is not None and hasattr(owner, flag):
                setattr(owner, flag, bool(enabled))


def set_triton_kernels(model: torch.nn.Module, enabled: bool) -> None:
    set_kernel_flag(model, "triton_kernels", enabled)
