"""Give the C heap's free pages back to the system after a phase that freed a lot.

glibc serves allocations below its mmap threshold from the heap, and the threshold rises to
the size of the largest mapped block freed so far (up to 32 MB), so the many temporaries of
a load (repacked GGUF slices, tiling passes, dequantized rows) end up on the heap; once
freed they stay resident until something calls malloc_trim. After loading Gemma3-270m gguf
with q8 tiles that is ~100 MB of RSS holding nothing.
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


def release_free_heap() -> bool:
    """malloc_trim(0) where the C library has it (glibc); False elsewhere (musl, macOS)."""
    lib = _libc()
    if lib is None:
        return False
    lib.malloc_trim(0)
    return True
