"""The one compiled kernel library (cpu_kernels.c and the files it includes), built once per
machine and opened through ctypes.

Why not a torch C++ extension: including the torch headers costs about a minute of compile
on two cores, while these plain C files build in seconds and need no torch ABI. The library
links the OpenMP runtime torch already loaded (same soname, so one thread pool).

The engine builds it at start-up (``build``, with a timeout), not inside the first request.
Where it cannot run (no C compiler, not x86-64 with AVX2 / FMA / F16C) or the build fails,
``library()`` is None, the reason is logged once as a warning (with the compiler's message),
and callers run their plain-PyTorch references. ``status()`` says which case this is.

The handle is process-wide on purpose: a loaded shared object cannot be unloaded, and
whether the kernels *run* for a model is that model's setting (``ModelConfig.cpu_kernels``),
held by the objects that call them, not by this module.

A build killed at any point leaves no library under the final name: the compiler writes a
``.build-<pid>-*.tmp`` file, renamed into place once whole, and a ``<library>.sha256`` is
written after. A library without a matching digest (a crash between the two, a truncated or
damaged file) is rebuilt, never opened: dlopen of a damaged ELF can crash the process rather
than raise. A dead build's temp file is removed by a later call.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

from tokenmill.config import CPU_ISAS
from tokenmill.utils.temp_files import remove_stale_temps, sha256_file

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(__file__), "cpu_kernels.c")
DEFAULT_BUILD_DIR = os.path.join(os.path.expanduser("~"), ".cache", "tokenmill", "kernels")
DEFAULT_BUILD_TIMEOUT_S = 300.0   # two cores build it in ~10-20 s; a wedged compiler must not hang start-up

_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]
# Where the CPU has AVX-512 VNNI the same sources are built with it too: the int8 dot
# products of the q8 kernels take one instruction instead of two (bit-identical results,
# qmm.c's dot_u8s8), and the tiled q8 GEMM (qgemm.c) runs on 512-bit registers.
_VNNI_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
_VNNI_CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
_NEEDED_CPU_FLAGS = {"avx2", "fma", "f16c"}


# Instruction sets the kernels may use (ModelConfig.cpu_isa, one of CPU_ISAS): "native" = all
# this CPU has; "avx512" = no AMX (bf16 mode on vdpbf16ps, as a Zen 4 runs it); "avx2" = what
# an AVX2-only CPU (AMD Zen 3, Intel before Ice Lake) has: the AVX2 build of the library,
# and no path that needs AVX-512 (bf16 compute). It lets one machine measure and check the
# code that other CPUs run.
# Flags an AVX2-only x86-64 CPU does not report (AVX-VNNI: Alder Lake's VEX form, unused here)
_ABOVE_AVX2 = ("avx512", "amx", "avx_vnni")
_isa = "native"


@functools.lru_cache(maxsize=None)
def _host_flags() -> frozenset:
    if platform.machine() not in ("x86_64", "AMD64"):
        return frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()


def cpu_flags() -> frozenset:
    """This CPU's flags as the kernels may use them: all of them, or under cpu_isa "avx2"
    those an AVX2-only CPU reports ("avx512": all but AMX's)."""
    flags = _host_flags()
    if _isa == "avx2":
        flags = frozenset(f for f in flags if not f.startswith(_ABOVE_AVX2))
    elif _isa == "avx512":
        flags = frozenset(f for f in flags if not f.startswith("amx"))
    return flags


def isa() -> str:
    """The instruction-set cap of this process's kernels (one of CPU_ISAS)."""
    return _isa


def use_isa(name: str) -> None:
    """Cap the kernels of this process at ``name`` (CPU_ISAS). The library is built once per
    process, so the cap is fixed from its build on: asking another one after that raises."""
    global _isa
    if name not in CPU_ISAS:
        raise ValueError(f"cpu_isa must be one of {', '.join(CPU_ISAS)}, got {name!r}")
    if name == _isa:
        return
    if _status.tried:
        raise RuntimeError(f"the kernel library of this process is already built for cpu_isa="
                           f"{_isa!r}; one process runs one instruction set (start another "
                           f"process for cpu_isa={name!r})")
    _isa = name


def cpu_supported() -> bool:
    return _NEEDED_CPU_FLAGS <= cpu_flags()


def has_vnni() -> bool:
    """True when this CPU runs the AVX-512 VNNI build (cpu_supported() implied)."""
    return cpu_supported() and _VNNI_CPU_FLAGS <= cpu_flags()


def has_avx512_bf16() -> bool:
    """True when this CPU multiplies bfloat16 natively (AVX-512 BF16: Zen 4+, Sapphire
    Rapids+); elsewhere bf16 GEMMs are emulated and far slower than float32."""
    return {"avx512f", "avx512_bf16"} <= cpu_flags()


def has_amx_bf16() -> bool:
    """True when this CPU has AMX tiles with bf16 products (Sapphire Rapids and newer Intel
    CPUs), which bf16 mode's matmuls then take (cpu_gemm_bf16.c's linear_bf16_amx)."""
    return {"amx_tile", "amx_bf16"} <= cpu_flags() and has_avx512_bf16()


def compiler() -> Optional[str]:
    """The C compiler the kernels are built with, or None when there is none."""
    return shutil.which("cc") or shutil.which("gcc")


def buildable() -> bool:
    """This machine should have the kernels: a supported CPU and a C compiler. Where this is
    True a failed build is a bug (tests fail rather than skip)."""
    return cpu_supported() and compiler() is not None


@functools.lru_cache(maxsize=None)
def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD), or "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""
    return line.partition(":")[2].strip()


# The tiled q8 GEMM prefetches its weight stream 4 KB ahead in the VNNI build on Intel CPUs
# (+15-24 % at 1-8 rows on an Emerald Rapids Xeon) and in every AVX2 build, at 1-2 rows
# (Zen 3: batch-1 gguf-q8 decode +4 to +22 % in interleaved runs, where the hardware
# prefetchers alone left one or two rows latency-bound). Not in the VNNI build on AMD: on
# Zen 4 it made the Gemma3 head slower (5.4 -> 5.6-5.8 ms).
_QG_PREFETCH_FLAG = "-DTM_QG_PREFETCH=4096"


def build_flags(vnni: Optional[bool] = None, qg_prefetch: Optional[bool] = None) -> list:
    """Compiler flags of the kernel library: AVX2 + FMA + F16C, plus AVX-512 VNNI when
    ``vnni`` (default: whether this CPU has it), plus the tiled GEMM's software prefetch when
    ``qg_prefetch`` (default: the AVX2 build, and the VNNI build on Intel CPUs)."""
    vnni = has_vnni() if vnni is None else vnni
    flags = _FLAGS + _VNNI_FLAGS if vnni else list(_FLAGS)
    if (not vnni or cpu_vendor() == "GenuineIntel") if qg_prefetch is None else qg_prefetch:
        flags.append(_QG_PREFETCH_FLAG)
    return flags


TEMP_PREFIX = ".build-"     # + "<pid>-": the compiler's output before the final rename
DIGEST_SUFFIX = ".sha256"   # beside a library: the sha256 of the file as it was built

_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def source_bytes(source: str) -> bytes:
    """The source and, recursively, the local files it includes: an edit to any of them
    must rebuild the library. A missing include is an error here, not a silent stale hash."""
    with open(source, "rb") as f:
        data = f.read()
    for name in _LOCAL_INCLUDE.findall(data):
        data += source_bytes(os.path.join(os.path.dirname(source), name.decode()))
    return data


class KernelBuildError(RuntimeError):
    """The compiler failed or timed out; the message carries what it printed."""


def build_shared_library(source: str, build_dir: Optional[str] = None,
                         flags: Optional[list] = None,
                         timeout_s: float = DEFAULT_BUILD_TIMEOUT_S) -> str:
    """Compile a C source into build_dir (named by a hash of source + flags) unless a sound
    build is already there; returns the .so path. Raises KernelBuildError (compiler message
    inside) or OSError."""
    flags = flags or build_flags()
    build_dir = build_dir or DEFAULT_BUILD_DIR
    digest = hashlib.sha256(source_bytes(source) + " ".join(flags).encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(source))[0]
    path = os.path.join(build_dir, f"{stem}-{digest}.so")
    if os.path.isdir(build_dir):
        # A live build holds its temp file at most timeout_s; an older one's owner is gone.
        remove_stale_temps(build_dir, TEMP_PREFIX, grace_s=timeout_s)
    problem = check_library(path)
    if problem is None:
        return path
    cc = compiler()
    if cc is None:
        raise KernelBuildError("no C compiler (cc / gcc) on PATH")
    os.makedirs(build_dir, exist_ok=True)
    if problem != "missing":   # damage is worth a warning; a missing digest is a cut build
        (logger.warning if problem.startswith("sha256") else logger.info)(
            "kernel library %s failed its check (%s); rebuilding it", path, problem)
    logger.info("compiling %s for this CPU (once per machine and source version) ...",
                os.path.basename(source))
    fd, tmp = tempfile.mkstemp(dir=build_dir, prefix=f"{TEMP_PREFIX}{os.getpid()}-", suffix=".tmp")
    os.close(fd)
    try:   # build to a temp name and rename: concurrent builders never see half a library
        returncode, stderr = _run_compiler([cc, *flags, source, "-o", tmp], timeout_s)
        if returncode != 0:
            raise KernelBuildError(f"{cc} exited with {returncode}: {stderr.strip()[-4000:]}")
        library_digest = sha256_file(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _write_digest(path, library_digest)
    return path


def check_library(path: str) -> Optional[str]:
    """None when ``path`` is a library exactly as it was built (its sha256 matches the
    digest written after the build; hashing it takes well under a millisecond), else what
    is wrong: "missing", no digest, or a mismatch."""
    if not os.path.isfile(path):
        return "missing"
    try:
        with open(path + DIGEST_SUFFIX) as f:
            expected = f.read(256).strip()
    except (OSError, UnicodeDecodeError):
        return "no digest beside it: its build did not finish"
    actual = sha256_file(path)
    return None if actual == expected else f"sha256 {actual}, expected {expected}"


def _write_digest(path: str, digest: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f"{TEMP_PREFIX}{os.getpid()}-",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(digest + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path + DIGEST_SUFFIX)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _run_compiler(cmd: list, timeout_s: float) -> tuple:
    """(exit code, stderr). The driver runs in its own process group so a timeout kills
    the compiler proper (cc1) too, not only the driver."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise KernelBuildError(f"{cmd[0]} did not finish within {timeout_s:g} s") from None
    return proc.returncode, stderr


@dataclass
class BuildStatus:
    """What one build gave: the opened library, or why there is none."""

    lib: Optional[ctypes.CDLL] = None
    path: Optional[str] = None
    error: Optional[str] = None
    seconds: float = 0.0
    tried: bool = False


_status = BuildStatus()


def build_library(source: str = SOURCE, build_dir: Optional[str] = None,
                  timeout_s: float = DEFAULT_BUILD_TIMEOUT_S) -> BuildStatus:
    """Build (cached per machine by content hash) and open a kernel library. A failure is
    logged as a warning with the reason and the fallback taken, never raised."""
    status = BuildStatus(tried=True)
    start = time.perf_counter()
    if not cpu_supported():
        status.error = "this CPU lacks AVX2 / FMA / F16C (or is not x86-64)"
    else:
        try:
            status.path = build_shared_library(source, build_dir, timeout_s=timeout_s)
            status.lib = declare(ctypes.CDLL(status.path))
            if has_amx_bf16() and status.lib.tm_amx_enable(1) != 0:
                logger.warning("the kernel refused AMX tile state to this process; bf16 "
                               "matmuls run on AVX-512 BF16 instead (slower from 4 rows up)")
        except (OSError, KernelBuildError, AttributeError) as e:
            status.error = f"{type(e).__name__}: {e}"
    status.seconds = time.perf_counter() - start
    if status.lib is None:
        logger.warning("tokenmill CPU kernels unavailable (%s); running the plain PyTorch paths "
                       "instead (slower, same results)", status.error)
    return status


def build(build_dir: Optional[str] = None,
          timeout_s: float = DEFAULT_BUILD_TIMEOUT_S) -> BuildStatus:
    """The process's one build of the kernel library (``build_library`` on first call)."""
    global _status
    if not _status.tried:
        _status = build_library(SOURCE, build_dir, timeout_s)
    return _status


def library() -> Optional[ctypes.CDLL]:
    """The opened library, or None where it cannot run here (built on first call)."""
    return _status.lib if _status.tried else build().lib


def bf16_kernel() -> Optional[str]:
    """Which kernel bf16 mode's matmuls take here: "amx" (tiles, for K % 32 == 0),
    "avx512" (vdpbf16ps), or None where bf16 mode is refused."""
    lib = library()
    if lib is None or not has_avx512_bf16():
        return None
    return "amx" if lib.tm_amx_active() else "avx512"


def require() -> ctypes.CDLL:
    """The library, or KernelBuildError with the reason (for tests and `tokenmill env`)."""
    lib = library()
    if lib is None:
        raise KernelBuildError(_status.error or "kernel library unavailable")
    return lib


def status() -> dict:
    """For `tokenmill env`: CPU support, compiler, build result."""
    s = build()
    return {"cpu_supported": cpu_supported(), "isa": _isa, "vnni": has_vnni(),
            "bf16_matmul": bf16_kernel() or "-", "compiler": compiler(),
            "built": s.lib is not None, "path": s.path, "error": s.error,
            "build_seconds": round(s.seconds, 3), "flags": " ".join(build_flags())}


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set the C signatures of every entry point (cpu_ops.c, cpu_attention.c, qmm.c,
    qgemm.c, cpu_decode.c, cpu_sync.c)."""
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    signatures = {
        "tm_rms_norm": ([p, p, p, f32, i32, i64, i64, p, i32], None),
        "tm_rope": ([p, p, i64, i64, i64, i64, i64, i64, p, p, p], None),
        "tm_silu_mul": ([p, i64, i64, p, i32], None),
        "tm_gelu_tanh_mul": ([p, i64, i64, p, i32], None),
        "tm_linear_small_m": ([p, i64, i64, p, i64, p, p, i32], None),
        "tm_linear_blocked": ([p, i64, i64, p, i64, p, p, i32], None),
        "tm_linear_half": ([p, i64, i64, p, i32, i64, p, p, i32], None),
        "tm_linear_bf16": ([p, i64, i64, p, i64, p, p, i32], i32),
        "tm_amx_enable": ([i32], i32),
        "tm_amx_active": ([], i32),
        "tm_argmax_rows": ([p, i64, i64, p, i32], None),
        "tm_nonfinite_rows": ([p, i64, i64, p, i32], i64),
        "tm_paged_attention": ([p, i64, i64, i64, p, p, p, p, i32, i64, i64, p, i64, i64, p,
                                p, p, p, f32, i64, p, i32], i32),
        "tm_prefill_attention": ([p, i64, i64, i64, p, p, p, p, i32, i64, i64, p, i64, i64, p,
                                  p, p, f32, i64, p, i32], i32),
        "tm_prefill_attention_bf16": ([p, i64, i64, i64, p, p, p, p, i32, i64, i64, p, i64, i64,
                                       p, p, p, f32, i64, p, i32], i32),
        "tm_llama_decode": ([p, i64, i64, i64, p, p, p, p, p, i32, i64, i64, i64, i64, p, i64,
                             p, i64, p, p, p, p, p, p, i32, i32, p, p, i64], i32),
        "tm_qmm": ([p, i64, i64, p, p, p, i64, i64, i32, p, i32], None),
        "tm_qmm_q8": ([p, i64, i64, p, p, p, i64, i64, i32, p, i32], i32),
        "tm_quantize_q8": ([p, i64, i64, p, p], None),
        "tm_dequant": ([p, p, p, i64, i64, i64, i32, p, i32], None),
        "tm_qgemm_q8": ([p, i64, i64, i32, p, p, p, i64, i64, p, i32], i32),
        "tm_tiled_rows": ([p, i32, i32, i64, i64, p, p, i32, i64, p, i64, p], i32),
        "tm_shm_barrier": ([p, i32, i32, i64, ctypes.c_double], i32),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib
