"""release_free_heap gives freed heap pages in the middle of the heap back; keep_freed_heap
keeps freed pages for the next step (glibc)."""
import ctypes
import ctypes.util
import resource

import pytest

from tokenmill.utils.heap import keep_freed_heap, release_free_heap


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.fixture
def libc():
    """The C library with malloc / free / memset callable on raw addresses (glibc only)."""
    name = ctypes.util.find_library("c")
    if name is None:
        pytest.skip("no C library to load")
    lib = ctypes.CDLL(name)
    if not (hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt")):
        pytest.skip("not glibc")
    lib.malloc.restype = ctypes.c_void_p
    lib.malloc.argtypes = [ctypes.c_size_t]
    lib.free.argtypes = [ctypes.c_void_p]
    lib.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    return lib


def test_freed_heap_pages_leave_rss(libc):
    # freeing a mapped 24 MB block raises glibc's mmap threshold: 1 MB blocks then come
    # from the heap, as a load's temporaries do
    big = libc.malloc(24 << 20)
    libc.memset(big, 1, 24 << 20)
    libc.free(big)
    blocks = [libc.malloc(1 << 20) for _ in range(96)]
    for b in blocks:
        libc.memset(b, 1, 1 << 20)
    keep = libc.malloc(1 << 20)   # above them: free() alone cannot shrink the heap's top
    for b in blocks:
        libc.free(b)
    before = _rss_mb()
    assert release_free_heap()
    after = _rss_mb()
    libc.free(keep)
    assert before - after > 48, f"RSS {before:.0f} -> {after:.0f} MB"


def test_kept_heap_serves_the_next_step_without_faults(libc):
    """After keep_freed_heap, large blocks freed and allocated again (a step's activations)
    reuse the same resident pages: no page is faulted in (and zeroed) a second time. Left to
    glibc, the 72 MB freed at the heap's top exceed its trim threshold (twice the largest
    mapped block freed) and go back to the system every step."""
    size = 24 << 20   # a 2048-token prefill's gate_up output in float32
    assert keep_freed_heap()

    def faults_of_one_step() -> int:   # three such blocks live at once, then all freed
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [libc.malloc(size) for _ in range(3)]
        for block in blocks:
            libc.memset(block, 1, size)
        for block in blocks:
            libc.free(block)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    faults_of_one_step()   # the first step brings the pages in
    later = [faults_of_one_step() for _ in range(2)]
    assert max(later) < 3 * (size >> 12) // 20, f"page faults {later} for blocks freed before"
