# usage: LIB=path/lib.so gemm_bf16_rows.py ROWS,..: tm_linear_bf16 vs the oneDNN bf16 path as prepacked.linear ran it (x to bf16, matmul, back to float32), SmolLM2 shapes, one W (in cache), 2 threads, GFLOP/s; rows <= 200 also checked bit for bit against linear_bf16_reference
import sys, os, time, ctypes, torch
from tokenmill.layers import native, cpu_ops
lib = native.declare(ctypes.CDLL(os.environ["LIB"]))
nt = 2; torch.set_num_threads(nt)
for m in [int(a) for a in sys.argv[1].split(",")]:
    for (n, k, name) in [(960,576,"qkv"),(3072,576,"gate_up"),(576,1536,"down"),(576,576,"o")]:
        w = torch.randn(n, k); x = torch.randn(m, k); y = torch.empty(m, n)
        pb = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 64); tl = cpu_ops.bf16_tiles(w)
        f1 = lambda: torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), pb, None, "none", [], "").float()
        f2 = lambda: lib.tm_linear_bf16(x.data_ptr(), m, k, tl.data_ptr(), n, None, y.data_ptr(), nt)
        reps = max(1, int(2e9 / (2*m*n*k)))
        best = [0, 0]
        for r in range(5):
            for j, f in enumerate((f1, f2)):
                t = time.perf_counter()
                for i in range(reps): f()
                best[j] = max(best[j], 2*m*n*k*reps/(time.perf_counter()-t)/1e9)
        ref = cpu_ops.linear_bf16_reference(x[:70], w) if m <= 200 else None
        f2(); ok = "" if ref is None else ("exact" if torch.equal(y[:70], ref) else "DIFF")
        print(m, name, "onednn-bf16 %.0f tm_linear_bf16 %.0f %s" % (best[0], best[1], ok), flush=True)
