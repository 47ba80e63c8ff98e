"""Give the C heap's free pages back to the system after a phase that freed a lot.

glibc serves allocations below its mmap threshold from the heap, and the threshold rises to
the size of the largest mapped block freed so far (up to 32 MB), so the many temporaries of
a load (repacked GGUF slices, tiling passes, dequantized rows) end up on the heap; once
freed they stay resident until something calls malloc_trim. After loading Gemma3-270m gguf
with q8 tiles that is ~100 MB of RSS holding nothing.

Once loaded, the opposite can cost: a 2048-token step's large temporaries (~25 MB outputs)
are freed layer after layer and allocated again by the next layer. Left to glibc, the free
top of the heap goes back to the system (its trim threshold follows the mmap threshold), and
the next layer faults every page in again, zeroed by the kernel. keep_freed_heap stops that;
the loader asks for it where that was measured to pay (bf16 mode).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _libc():
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None   # glibc only


# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20   # the largest mmap threshold glibc accepts on 64-bit


def keep_freed_heap(trim_above: int = 256 << 20) -> bool:
    """From now on serve blocks up to 32 MB from the heap and keep freed heap pages until
    more than ``trim_above`` bytes are free at its top, so a step's temporaries reuse the
    pages the previous step freed. glibc only; False elsewhere or when refused. Process-wide,
    as any allocator setting is; release_free_heap still gives everything free back."""
    lib = _libc()
    if lib is None or not hasattr(lib, "mallopt"):
        return False
    return bool(lib.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) \
        and bool(lib.mallopt(_M_TRIM_THRESHOLD, trim_above))


def release_free_heap() -> bool:
    """malloc_trim(0) where the C library has it (glibc); False elsewhere (musl, macOS)."""
    lib = _libc()
    if lib is None:
        return False
    lib.malloc_trim(0)
    return True
