# tm_linear_blocked (C, plain W) vs oneDNN prepacked fp32, SmolLM2 shapes, GFLOP/s, 2 threads
import sys, time, torch
from tokenmill.layers import native, prepacked
torch.set_num_threads(2)
import os, ctypes
lib = native.declare(ctypes.CDLL(os.environ["LIB"])) if os.environ.get("LIB") else native.library()
shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
for M in [int(a) for a in sys.argv[1].split(",")]:
    for name, (N, K) in shapes.items():
        if name == "head" and M > 64: continue
        ws = [torch.randn(N, K) for _ in range(max(1, 200_000_000 // (N * K * 4 * 2)))]   # > L3: W from memory
        x = torch.randn(M, K)
        packs = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in ws]
        y = torch.empty(M, N)
        def c(i): lib.tm_linear_blocked(x.data_ptr(), M, K, ws[i].data_ptr(), N, None, y.data_ptr(), 2)
        def d(i): torch.ops.mkldnn._linear_pointwise(x, packs[i], None, "none", [], "")
        res = {}
        for rep in range(3):
            for nm, f in (("c", c), ("onednn", d)):
                t = time.perf_counter(); n = 0
                while time.perf_counter() - t < 0.4:
                    f(n % len(ws)); n += 1
                res.setdefault(nm, []).append(2 * M * N * K * n / (time.perf_counter() - t) / 1e9)
        c(0); ref = torch.ops.mkldnn._linear_pointwise(x, packs[0], None, "none", [], "")
        print(M, name, "C %.0f onednn %.0f  maxdiff %.1e" % (max(res["c"]), max(res["onednn"]), (y - ref).abs().max()), flush=True)
