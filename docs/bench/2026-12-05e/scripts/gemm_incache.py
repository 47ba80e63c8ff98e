import time, torch
from tokenmill.layers import native
torch.set_num_threads(2); lib = native.library()
for M, N, K in ((60, 256, 576), (60, 1024, 576), (120, 256, 576), (60, 256, 1536)):
    w = torch.randn(N, K); x = torch.randn(M, K); y = torch.empty(M, N)
    pk = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    for nm, f in (("C", lambda: lib.tm_linear_blocked(x.data_ptr(), M, K, w.data_ptr(), N, None, y.data_ptr(), 2)),
                  ("onednn", lambda: torch.ops.mkldnn._linear_pointwise(x, pk, None, "none", [], ""))):
        best = 0
        for r in range(3):
            t = time.perf_counter(); n = 0
            while time.perf_counter() - t < 0.3: f(); n += 1
            best = max(best, 2 * M * N * K * n / (time.perf_counter() - t) / 1e9)
        print(M, N, K, nm, round(best))
