# usage: gemv_ab.py DIR...: tm_linear_small_m of each DIR/lib.so at MS rows (default 1,4), SmolLM2 shapes, 256 MB of distinct weights (from memory), best of 5 alternating, GB/s
import sys, time, torch, ctypes, os
from tokenmill.layers import native
torch.set_num_threads(2)
libs = {d: native.declare(ctypes.CDLL(d + "/lib.so")) for d in sys.argv[1:]}
for m in [int(a) for a in os.environ.get("MS", "1,4").split(",")]:
    for (n, k, name) in [(960,576,"qkv"),(3072,576,"gate_up"),(576,1536,"down"),(49152,576,"head")]:
        copies = max(1, (256 << 20) // (n * k * 4))
        ws = [torch.randn(n, k) for _ in range(copies)]
        x = torch.randn(m, k); y = torch.empty(m, n)
        best = {d: 0 for d in libs}
        for r in range(5):
            for d, lib in libs.items():
                t = time.perf_counter()
                for w in ws: lib.tm_linear_small_m(x.data_ptr(), m, k, w.data_ptr(), n, None, y.data_ptr(), 2)
                best[d] = max(best[d], n * k * 4 * copies / (time.perf_counter() - t) / 1e9)
        print(m, name, "  ".join(f"{os.path.basename(d)} {v:.1f}" for d, v in best.items()), flush=True)
