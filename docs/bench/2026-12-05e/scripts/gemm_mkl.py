import time, torch
import torch.nn.functional as F
from tokenmill.layers import native, cpu_ops
torch.set_num_threads(2); lib = native.library()
for M in (128, 512, 2048):
  for name, (N, K) in {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}.items():
    ws = [torch.randn(N, K) for _ in range(max(1, 200_000_000 // (N * K * 8)))]
    x = torch.randn(M, K); y = torch.empty(M, N)
    res = {}
    for nm, f in (("C", lambda i: lib.tm_linear_blocked(x.data_ptr(), M, K, ws[i].data_ptr(), N, None, y.data_ptr(), 2)),
                  ("many_rows", lambda i: cpu_ops.linear_many_rows(x, ws[i])), ("F.linear", lambda i: F.linear(x, ws[i]))):
        best = 0
        for r in range(2):
            t = time.perf_counter(); n = 0
            while time.perf_counter() - t < 0.3: f(n % len(ws)); n += 1
            best = max(best, 2 * M * N * K * n / (time.perf_counter() - t) / 1e9)
        res[nm] = round(best)
    print(M, name, res, flush=True)
