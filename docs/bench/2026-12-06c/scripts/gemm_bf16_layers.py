# M-row bf16 linear over 30 layers of SmolLM2-shaped weights (streams from memory like a decode step)
import sys, time, torch
from tokenmill.layers import cpu_ops
torch.manual_seed(0)
M = int(sys.argv[1]) if len(sys.argv) > 1 else 32
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]   # qkv, o, gate_up, down
layers = [[cpu_ops.bf16_tiles(torch.randn(n, k) * 0.02) for n, k in shapes] for _ in range(30)]
head = cpu_ops.bf16_tiles(torch.randn(49152, 576) * 0.02)
xs = {k: torch.randn(M, k) for k in (576, 1536)}
flops = 2 * M * (30 * sum(n * k for n, k in shapes) + 49152 * 576)
def step():
    for L in layers:
        for (n, k), t in zip(shapes, L):
            cpu_ops.linear_bf16(xs[k], t)
    cpu_ops.linear_bf16(xs[576], head)
for _ in range(3): step()
ts = []
for _ in range(15):
    t = time.perf_counter(); step(); ts.append(time.perf_counter() - t)
ts.sort(); med = ts[len(ts) // 2]
print(f"M={M} step {med*1e3:.2f} ms (min {ts[0]*1e3:.2f})  {flops/med/1e9:.0f} GFLOP/s")
