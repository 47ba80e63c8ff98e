# usage: python gemm_cache.py: tm_linear_blocked at 32 / 64 rows on SmolLM2 shapes, one weight copy (cache) vs 256 MB of copies (mem), GFLOP/s
import os, sys, time, torch
sys.path.insert(0, os.environ.get("TREE", "/work/main"))
from tokenmill.layers import native
lib = native.library()
nt = 2; torch.set_num_threads(nt)
for m in [32, 64]:
    for (n, k, name) in [(960,576,"qkv"),(3072,576,"gate_up"),(576,1536,"down")]:
        for mode in ["cache", "mem"]:
            copies = 1 if mode == "cache" else max(1, (256 << 20) // (n * k * 4))
            ws = [torch.randn(n, k) for _ in range(copies)]
            reps = 200 if mode == "cache" else 1
            x = torch.randn(m, k); y = torch.empty(m, n)
            best = 0
            for r in range(5):
                t = time.perf_counter()
                for _ in range(reps):
                    for w in ws: lib.tm_linear_blocked(x.data_ptr(), m, k, w.data_ptr(), n, None, y.data_ptr(), nt)
                best = max(best, 2*m*n*k*copies*reps/(time.perf_counter()-t)/1e9)
            print(m, name, mode, "%.0f GFLOP/s" % best, flush=True)
