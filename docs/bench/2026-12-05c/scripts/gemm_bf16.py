# usage: gemm_bf16.py ROWS,..: oneDNN fp32 vs bf16 prepacked vs our blocked fp32 kernel vs our bf16 tiles (tm_linear_bf16, up to 64 rows) at SmolLM2 shapes, W from memory, 2 threads, GFLOP/s
# oneDNN fp32 prepacked vs oneDNN bf16 prepacked vs our blocked fp32 kernel, SmolLM2 shapes, W from memory
import sys, time, torch
from tokenmill.layers import native, cpu_ops
lib = native.library()
nt = 2; torch.set_num_threads(nt)
ms = [int(a) for a in sys.argv[1].split(",")]
for m in ms:
    for (n, k, name) in [(960,576,"qkv"),(3072,576,"gate_up"),(576,1536,"down"),(49152,576,"head")]:
        copies = max(1, (256 << 20) // (n * k * 4))
        ws = [torch.randn(n, k) for _ in range(copies)]
        x = torch.randn(m, k); y = torch.empty(m, n); xb = x.bfloat16()
        ps = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in ws]
        pb = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 64) for w in ws]
        tl = [cpu_ops.bf16_tiles(w) for w in ws]
        fs = (lambda i: lib.tm_linear_blocked(x.data_ptr(), m, k, ws[i].data_ptr(), n, None, y.data_ptr(), nt) if m <= 64 else None,
              lambda i: torch.ops.mkldnn._linear_pointwise(x, ps[i], None, "none", [], ""),
              lambda i: torch.ops.mkldnn._linear_pointwise(xb, pb[i], None, "none", [], ""),
              lambda i: lib.tm_linear_bf16(x.data_ptr(), m, k, tl[i].data_ptr(), n, None, y.data_ptr(), nt) if m <= 64 else None)
        best = [0, 0, 0, 0]
        for r in range(4):
            for j, f in enumerate(fs):
                t = time.perf_counter()
                for i in range(copies): f(i)
                best[j] = max(best[j], 2*m*n*k*copies/(time.perf_counter()-t)/1e9)
        print(m, name, "ours-fp32 %.0f onednn-fp32 %.0f onednn-bf16 %.0f ours-bf16 %.0f" % tuple(best), flush=True)
