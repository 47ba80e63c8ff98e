"""`tokenmill env`: what this machine and install run (like `vllm collect-env` or llama.cpp's
system info): versions, CPU features, which kernels are built and active, threads, cache
folders, whether a GPU is visible. Paste its output into bug reports."""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
from typing import Optional

_PACKAGES = ("torch", "numpy", "tokenizers", "safetensors", "transformers", "fastapi", "uvicorn",
             "pydantic", "gguf", "llama-cpp-python", "triton", "ray")
_CPU_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                 "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def _version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _kernels(status: dict) -> dict:
    """Each fast path and whether it runs in an engine with default settings here."""
    from tokenmill.layers import prepacked
    built = status["built"]
    return {
        "fused rms_norm / rope / silu_mul / small-M GEMV": built,
        "paged attention (cpu_attention.c)": built,
        "one-call decode stack (cpu_decode.c)": built,
        "quantized matmul int8 / int4 / fp8 (qmm.c)": built,
        "tiled q8 GEMM (qgemm.c)": f"{'AVX-512 VNNI' if status['vnni'] else 'AVX2'} build" if built else False,
        "oneDNN prepacked float32 weights": prepacked.available(),
    }


def collect(cache_dir: Optional[str]) -> dict:
    """Everything `tokenmill env` prints, as a dict (builds the kernel library if needed)."""
    import torch

    import tokenmill
    from tokenmill.layers import native
    from tokenmill.models.hub import DEFAULT_CACHE_DIR
    status = native.status()
    flags = native.cpu_flags()
    cuda = torch.cuda.is_available()
    return {
        "tokenmill": {"version": tokenmill.__version__,
                      "location": os.path.dirname(os.path.abspath(tokenmill.__file__))},
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {p: _version(p) for p in _PACKAGES},
        "cpu": {"model": _cpu_model(), "cores": os.cpu_count(),
                "features": [f for f in _CPU_FEATURES if f in flags]},
        "threads": {"torch": torch.get_num_threads(),
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
        "kernel_library": status,
        "kernels_active": _kernels(status),
        "caches": {"models": cache_dir or DEFAULT_CACHE_DIR, "kernels": native.DEFAULT_BUILD_DIR},
        "gpu": {"cuda_available": cuda, "torch_cuda": torch.version.cuda,
                "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                if cuda else []},
        "settings_from_env": {k: v for k, v in os.environ.items() if k.startswith("TOKENMILL_")},
    }


def _print_text(info: dict) -> None:
    for key, value in info.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k}: {v if v is not None else '-'}")
        else:
            print(f"{key}: {value}")


def cmd_env(args) -> int:
    info = collect(args.cache_dir)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_text(info)
    return 0


def add_env_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="versions, CPU features, kernels built and active, caches, GPU")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--cache-dir", default=os.environ.get("TOKENMILL_CACHE"),
                   help="model cache to report (default: TOKENMILL_CACHE or ~/.cache/tokenmill)")
    p.set_defaults(func=cmd_env)
