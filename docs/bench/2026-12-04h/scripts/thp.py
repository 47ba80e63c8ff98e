# usage: python thp.py LIBDIR/lib.so (MS=1,32): tm_linear_blocked with W in 4 KB pages vs madvise(MADV_HUGEPAGE) pages, 256 MB of copies, GFLOP/s
import sys, time, ctypes, torch, os
torch.set_num_threads(2)
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
l = ctypes.CDLL(sys.argv[1])
f = l.tm_linear_blocked; f.restype = None
f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
def huge_empty(numel):
    # over-allocate to align to 2 MB, madvise before first touch
    raw = torch.empty(numel + (1 << 19), dtype=torch.float32)
    p = raw.data_ptr(); a = (p + (1 << 21) - 1) & ~((1 << 21) - 1)
    off = (a - p) // 4
    t = raw[off:off + numel]
    r = libc.madvise(a, (numel * 4) & ~((1 << 21) - 1), 14)
    assert r == 0, ctypes.get_errno()
    return t
ms = [int(a) for a in os.environ.get("MS", "1,32").split(",")]
for m in ms:
  for (n, k, name) in [(960,576,"qkv"),(3072,576,"gate_up"),(576,1536,"down"),(49152,576,"head")]:
    copies = max(1, (256 << 20) // (n * k * 4))
    small = [torch.randn(n, k) for _ in range(copies)]
    big = huge_empty(copies * n * k); big.copy_(torch.cat([w.reshape(-1) for w in small]))
    hp = [big[i*n*k:(i+1)*n*k] for i in range(copies)]
    x = torch.randn(m, k); y = torch.empty(m, n)
    best = [0, 0]
    for r in range(5):
        for i, ws in enumerate((small, hp)):
            t = time.perf_counter()
            for w in ws: f(x.data_ptr(), m, k, w.data_ptr(), n, None, y.data_ptr(), 2)
            best[i] = max(best[i], 2*m*n*k*copies/(time.perf_counter()-t)/1e9)
    print(m, name, "4k %.0f  thp %.0f" % tuple(best), flush=True)
    del big, hp
print(open("/proc/meminfo").read().split("AnonHugePages:")[1].split("\n")[0])
