# usage: python gemm_vs_onednn.py THREADS [ROWS,..]: the blocked float kernel vs oneDNN prepacked at SmolLM2 shapes, 256 MB of distinct weights per shape (W from memory), best of 5 alternating rounds, GFLOP/s
import sys, time, torch
sys.path.insert(0, "/work/main")
from tokenmill.layers import native
lib = native.library()
nt = int(sys.argv[1]); torch.set_num_threads(nt)
ms = [int(a) for a in sys.argv[2].split(",")] if len(sys.argv) > 2 else [16, 32, 64]
for m in ms:
    for (n, k, name) in [(960,576,"qkv"),(3072,576,"gate_up"),(576,1536,"down"),(49152,576,"head")]:
        # a model's worth of distinct weights so W comes from memory, as in a decode step
        copies = max(1, (256 << 20) // (n * k * 4))
        ws = [torch.randn(n, k) for _ in range(copies)]
        x = torch.randn(m, k); y = torch.empty(m, n)
        ps = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in ws]
        fs = (lambda w, p: lib.tm_linear_blocked(x.data_ptr(), m, k, w.data_ptr(), n, None, y.data_ptr(), nt),
              lambda w, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))
        best = [0, 0]
        for r in range(5):
            for i, f in enumerate(fs):
                t = time.perf_counter()
                for w, p in zip(ws, ps): f(w, p)
                best[i] = max(best[i], 2*m*n*k*copies/(time.perf_counter()-t)/1e9)
        print(nt, m, name, "ours %.0f onednn %.0f" % tuple(best), flush=True)
