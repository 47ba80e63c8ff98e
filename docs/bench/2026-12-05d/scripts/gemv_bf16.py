# usage: LIB=path/lib.so gemv_bf16.py ROWS,..: tm_linear_bf16 at few rows vs the float32 GEMV (tm_linear_small_m), W from memory (256 MB of float weights), 2 threads
import sys, os, time, ctypes, torch
from tokenmill.layers import native, cpu_ops
lib = native.declare(ctypes.CDLL(os.environ["LIB"]))
nt = 2; torch.set_num_threads(nt)
for m in [int(a) for a in sys.argv[1].split(",")]:
    for (n, k, name) in [(960,576,"qkv"),(3072,576,"gate_up"),(576,1536,"down"),(49152,576,"head")]:
        copies = max(1, (256 << 20) // (n * k * 4))
        ws = [torch.randn(n, k) for _ in range(copies)]; tl = [cpu_ops.bf16_tiles(w) for w in ws]
        x = torch.randn(m, k); y = torch.empty(m, n)
        f1 = lambda i: lib.tm_linear_small_m(x.data_ptr(), m, k, ws[i].data_ptr(), n, None, y.data_ptr(), nt)
        f2 = lambda i: lib.tm_linear_bf16(x.data_ptr(), m, k, tl[i].data_ptr(), n, None, y.data_ptr(), nt)
        best = [1e9, 1e9]
        for r in range(5):
            for j, f in enumerate((f1, f2)):
                t = time.perf_counter()
                for i in range(copies): f(i)
                best[j] = min(best[j], time.perf_counter() - t)
        print(m, name, "fp32 %.1f GB/s  bf16 tiles %.1f GB/s (of bf16 bytes)  speedup %.2fx" % (n*k*4*copies/best[0]/1e9, n*k*2*copies/best[1]/1e9, best[0]/best[1]), flush=True)
