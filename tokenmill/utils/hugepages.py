"""Huge (2 MB) pages for the memory a decode step streams: the weights and the KV cache.

A decode step reads every weight, and at long contexts every cached key and value, once.
Through 4 KB pages each page is a TLB miss, and in a virtual machine each miss is a nested
page walk. On a 2-vCPU Xeon VM the same read ran 23.6-24.2 GB/s over 4 KB pages and 28.5-30.8
over 2 MB pages; the decode GEMVs over 30 layers of weights 23.8-25.1 and 26.8-27.5 GB/s;
long-context decode attention 9-14 % faster (docs/bench/2026-12-07i).

Linux only, through transparent huge pages: with THP in "madvise" mode (the common default)
memory gets huge pages only where asked. Two ways in:
- ``anonymous_map``: a fresh private mapping advised MADV_HUGEPAGE before anything touches
  it, so its pages fault in 2 MB at a time (the KV cache; resident memory then grows in 2 MB
  steps per cache tensor, not 4 KB ones);
- ``collapse_dense_memory``: after the weights are in place, MADV_COLLAPSE rewrites each
  2 MB stretch of anonymous memory that is already (nearly) all resident as one huge page,
  in place (no address changes). Stretches with fewer resident pages are left alone, so it
  adds at most a tenth of what it collapses to the resident size.
Anywhere else (other systems, THP off, kernels before 6.1 for MADV_COLLAPSE) both fall back
to ordinary pages.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import os
import sys

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_PAGE = mmap.PAGESIZE
_MADV_COLLAPSE = 25    # linux/mman.h, Linux 6.1+
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.lru_cache(maxsize=None)
def supported() -> bool:
    """Linux with transparent huge pages not switched off."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open(_THP_ENABLED) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


@functools.lru_cache(maxsize=None)
def _libc():
    try:
        lib = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    if not (hasattr(lib, "madvise") and hasattr(lib, "mincore")):
        return None
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return lib


def anonymous_map(nbytes: int, huge: bool) -> mmap.mmap:
    """A private anonymous mapping of ``nbytes`` (zero pages, faulted in on first write);
    with ``huge`` (and THP available) advised to fault in 2 MB pages."""
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and supported() and hasattr(pages, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            pages.madvise(mmap.MADV_HUGEPAGE)
        except OSError as e:   # refused: ordinary pages, as without the flag
            logger.debug("MADV_HUGEPAGE refused: %s", e)
    return pages


def _anonymous_ranges(min_bytes: int) -> list[tuple[int, int]]:
    """Writable private anonymous mappings (and the heap) of this process of at least
    ``min_bytes`` with resident 4 KB pages left, as (start, end): those already all on huge
    pages are skipped (a process that loads several models would collapse them again)."""
    ranges, current = [], None
    with open(f"/proc/{os.getpid()}/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):   # a mapping's header line
                name = fields[5] if len(fields) > 5 else ""
                start, end = (int(x, 16) for x in fields[0].split("-"))
                current = None
                if fields[1] == "rw-p" and (not name or name == "[heap]") and end - start >= min_bytes:
                    current = [start, end, 0]
            elif current is not None and fields[0] == "Rss:":
                current[2] = int(fields[1])
            elif current is not None and fields[0] == "AnonHugePages:":
                if current[2] - int(fields[1]) >= HUGE_PAGE // 1024:   # kB of small pages
                    ranges.append((current[0], current[1]))
                current = None
    return ranges


def collapse_dense_memory(min_resident: float = 0.9) -> int:
    """Back every 2 MB-aligned stretch of this process's anonymous memory with at least
    ``min_resident`` of its pages resident by one huge page (MADV_COLLAPSE). Called once the
    weights are loaded: their stretches are dense. Returns the bytes collapsed (0 where the
    system cannot)."""
    lib = _libc()
    if lib is None or not supported():
        return 0
    per_chunk = HUGE_PAGE // _PAGE
    need = int(per_chunk * min_resident)
    vec = ctypes.create_string_buffer(per_chunk)
    collapsed = 0
    for start, end in _anonymous_ranges(2 * HUGE_PAGE):
        for chunk in range(-(-start // HUGE_PAGE) * HUGE_PAGE, end - HUGE_PAGE + 1, HUGE_PAGE):
            if lib.mincore(chunk, HUGE_PAGE, vec) != 0:
                continue
            if sum(b & 1 for b in vec.raw) < need:
                continue
            # EINVAL: a mapping that cannot, or a kernel without MADV_COLLAPSE: on to the next
            # mapping; other failures (no free huge page just now) skip this stretch only
            if lib.madvise(chunk, HUGE_PAGE, _MADV_COLLAPSE) == 0:
                collapsed += HUGE_PAGE
            elif ctypes.get_errno() == errno.EINVAL:
                break
    return collapsed
