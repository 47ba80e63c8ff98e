# fp32 blocked GEMM at M rows: SmolLM2's 4 matmul shapes x L layers of weights, cycled (L=30: from memory, L=1: hot)
import time, torch, sys
from tokenmill.layers import cpu_ops
torch.set_num_threads(2)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
for L in (1, 30):
    layers = [[torch.randn(n, k) * 0.05 for n, k in shapes] for _ in range(L)]
    flop_per_row = sum(2 * n * k for n, k in shapes) * L
    nbytes = sum(n * k * 4 for n, k in shapes) * L
    M = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    xs = {k: torch.randn(M, k) for k in (576, 1536)}
    def step():
        for l in layers:
            for w in l:
                cpu_ops.linear(xs[w.shape[1]], w)
    step()
    best = 1e9
    for _ in range(10):
        s = time.perf_counter(); step(); best = min(best, time.perf_counter() - s)
    print(f"L{L} M{M}: {best*1e3:.2f} ms, {M*flop_per_row/best/1e9:.0f} GFLOP/s, {nbytes/best/1e9:.1f} GB/s of W", flush=True)
