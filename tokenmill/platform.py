"""Device and dtype choice, made once at engine start."""
from __future__ import annotations

import os
from typing import Optional

import torch


def pick_device(requested: str = "auto") -> torch.device:
    """"auto": CUDA when a GPU is visible, else the CPU; "cuda" without one is an error."""
    if requested == "cpu":
        return torch.device("cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for, but torch sees no CUDA GPU "
                         f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    if requested not in ("auto", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {requested!r}")
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' is float32 on CPU (bf16 GEMM is ~60x slower there without AVX-512) and bfloat16
    on CUDA."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        return os.cpu_count() or 1


def set_num_threads(num_threads: Optional[int]) -> int:
    """Torch intra-op threads; default = every core this process may use."""
    if num_threads is None:
        num_threads = usable_cores()
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    torch.set_num_threads(num_threads)
    return num_threads
