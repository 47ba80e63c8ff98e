"""The compiled quantized matmul (qmm.c), built once per machine and called through ctypes.

Why not a torch C++ extension: including the torch headers costs about a minute of compile
on two cores, while this plain C file builds in about a second and needs no torch ABI. It
links the OpenMP runtime torch already loaded (same soname, so one thread pool).
Where it cannot run (no compiler, not x86-64 AVX2/FMA/F16C) ``available()`` is False and
callers use the plain-PyTorch reference instead.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import subprocess
import tempfile
from typing import Optional

import torch

KIND_I8, KIND_I4, KIND_F8 = 0, 1, 2
KIND_HALF = 8   # flag (i8 / i4): scales and mins are float16


def kind_code(kind: int, scales: torch.Tensor) -> int:
    """The C kind of a weight whose scales have this dtype."""
    return kind | KIND_HALF if scales.dtype is torch.float16 else kind
_SOURCE = os.path.join(os.path.dirname(__file__), "qmm.c")
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]
# Where the CPU has AVX-512 VNNI the same sources are built with it too: the int8 dot
# products of the q8 kernels take one instruction instead of two (bit-identical results,
# qmm.c's dot_u8s8), and the tiled q8 GEMM (qgemm.c) runs on 512-bit registers.
_VNNI_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
_VNNI_CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
_DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "tokenmill", "kernels")

_lib: Optional[ctypes.CDLL] = None
_tried = False


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> frozenset:
    if platform.machine() not in ("x86_64", "AMD64"):
        return frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()


def cpu_supported() -> bool:
    return {"avx2", "fma", "f16c"} <= _cpu_flags()


def has_vnni() -> bool:
    """True when this CPU runs the AVX-512 VNNI build (cpu_supported() implied)."""
    return cpu_supported() and _VNNI_CPU_FLAGS <= _cpu_flags()


def build_flags(vnni: Optional[bool] = None) -> list:
    """Compiler flags of the kernel libraries: AVX2 + FMA + F16C, plus AVX-512 VNNI when
    ``vnni`` (default: whether this CPU has it)."""
    return _FLAGS + _VNNI_FLAGS if (has_vnni() if vnni is None else vnni) else list(_FLAGS)


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _source_bytes(source: str) -> bytes:
    """The source and, recursively, the local headers it includes: a header edit must
    rebuild the library like a source edit does."""
    with open(source, "rb") as f:
        data = f.read()
    for name in _LOCAL_INCLUDE.findall(data):
        header = os.path.join(os.path.dirname(source), name.decode())
        if os.path.isfile(header):
            data += _source_bytes(header)
    return data


def build_shared_library(source: str, build_dir: Optional[str] = None,
                         flags: Optional[list] = None) -> str:
    """Compile a C source into build_dir (named by a hash of source + flags) unless already
    there; returns the .so path. Raises OSError / CalledProcessError when it cannot."""
    flags = flags or build_flags()
    build_dir = build_dir or _DEFAULT_DIR
    digest = hashlib.sha256(_source_bytes(source) + " ".join(flags).encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(source))[0]
    path = os.path.join(build_dir, f"{stem}-{digest}.so")
    if os.path.isfile(path):
        return path
    os.makedirs(build_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=build_dir, suffix=".so")
    os.close(fd)
    try:   # build to a temp name and rename: concurrent builders never see half a library
        subprocess.run(["cc", *flags, source, "-o", tmp], check=True, capture_output=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def open_library(source: str, build_dir: Optional[str] = None) -> Optional[ctypes.CDLL]:
    """Build (once per machine) and open a kernel library; None where this CPU or toolchain
    cannot run it, so callers fall back to PyTorch."""
    if not cpu_supported():
        return None
    try:
        return ctypes.CDLL(build_shared_library(source, build_dir))
    except (OSError, subprocess.CalledProcessError):
        return None


def load(build_dir: Optional[str] = None) -> Optional[ctypes.CDLL]:
    """The library, or None where it cannot be built or run here. Tried once per process."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    lib = open_library(_SOURCE, build_dir)
    if lib is None:
        return None
    _lib = declare(lib)
    return _lib


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set the C signatures of a qmm.c library (any build of it)."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.tm_qmm.argtypes = [p, i64, i64, p, p, p, i64, i64, i32, p, i32]
    lib.tm_qmm.restype = None
    lib.tm_qmm_q8.argtypes = [p, i64, i64, p, p, p, i64, i64, i32, p, i32]
    lib.tm_qmm_q8.restype = i32
    lib.tm_quantize_q8.argtypes = [p, i64, i64, p, p]
    lib.tm_quantize_q8.restype = None
    lib.tm_dequant.argtypes = [p, p, p, i64, i64, i64, i32, p, i32]
    lib.tm_dequant.restype = None
    lib.tm_qgemm_q8.argtypes = [p, i64, i64, i32, p, p, p, i64, i64, p, i32]
    lib.tm_qgemm_q8.restype = i32
    return lib


def available() -> bool:
    return load() is not None


def qmm(x: torch.Tensor, kind: int, w: torch.Tensor, scales: torch.Tensor,
        mins: Optional[torch.Tensor], group_size: int, n: int) -> torch.Tensor:
    """x [M, K] float32 contiguous -> [M, N]; w [N, K] int8/uint8 or [N, K/2] uint8;
    scales / mins [N, K/group_size] float32 (or float16, i8 / i4), contiguous. The caller
    checks availability."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32)
    _lib.tm_qmm(x.data_ptr(), m, k, w.data_ptr(), scales.data_ptr(),
                mins.data_ptr() if mins is not None else None, group_size, n, kind_code(kind, scales),
                y.data_ptr(), torch.get_num_threads())
    return y


def qmm_q8(x: torch.Tensor, kind: int, w: torch.Tensor, scales: torch.Tensor,
           mins: Optional[torch.Tensor], group_size: int, n: int) -> torch.Tensor:
    """Like ``qmm`` with x quantized to int8 per run of 32 values first (integer dot
    products); kinds KIND_I8 / KIND_I4 only, K and group_size multiples of 32."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32)
    if _lib.tm_qmm_q8(x.data_ptr(), m, k, w.data_ptr(), scales.data_ptr(),
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
    _lib.tm_quantize_q8(x.data_ptr(), m, k, q.data_ptr(), d.data_ptr())
    return q, d


def dequant(kind: int, w: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor],
            group_size: int, n: int, k: int) -> torch.Tensor:
    """float32 [N, K] in stored column order (same contract as ``qmm``)."""
    out = torch.empty(n, k, dtype=torch.float32)
    _lib.tm_dequant(w.data_ptr(), scales.data_ptr(), mins.data_ptr() if mins is not None else None,
                    group_size, n, k, kind_code(kind, scales), out.data_ptr(), torch.get_num_threads())
    return out
