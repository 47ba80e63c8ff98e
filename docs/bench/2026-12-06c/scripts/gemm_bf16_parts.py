# tm_linear_bf16 per matrix shape (30 layers of SmolLM2 shapes, then the head), M rows: usage gemm_bf16_parts.py M
import sys, time, torch
from tokenmill.layers import cpu_ops
torch.manual_seed(0)
M = int(sys.argv[1])
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
layers = [[cpu_ops.bf16_tiles(torch.randn(n, k) * 0.02) for n, k in shapes] for _ in range(30)]
head = cpu_ops.bf16_tiles(torch.randn(49152, 576) * 0.02)
xs = {k: torch.randn(M, k) for k in (576, 1536)}
def timeit(f, flops):
    for _ in range(3): f()
    ts = []
    for _ in range(11):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    ts.sort(); med = ts[len(ts)//2]; return med * 1e3, flops / med / 1e9
for i, (n, k) in enumerate(shapes):
    ms, gf = timeit(lambda: [cpu_ops.linear_bf16(xs[k], L[i]) for L in layers], 2*M*n*k*30)
    print(f"{n}x{k} x30: {ms:.2f} ms {gf:.0f} GFLOP/s")
ms, gf = timeit(lambda: cpu_ops.linear_bf16(xs[576], head), 2*M*49152*576)
print(f"head: {ms:.2f} ms {gf:.0f} GFLOP/s")
