# AMX bf16 at M rows with weights streamed from memory: 30 layers of SmolLM2's 4 matmuls, cycled
import time, torch, sys
from tokenmill.layers import cpu_ops, native
torch.set_num_threads(2)
lib = native.library()
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
layers = [[cpu_ops.bf16_tiles(torch.randn(n, k) * 0.05) for n, k in shapes] for _ in range(30)]
nbytes = sum(t.numel() * 2 for l in layers for t in l)
for M in [int(a) for a in sys.argv[1:]] or [1, 8, 32, 64]:
    xs = {k: torch.randn(M, k) for k in (576, 1536)}
    def step():
        for l in layers:
            for t in l:
                cpu_ops.linear_bf16(xs[t.shape[1] * 2], t)
    step()
    best = 1e9
    for _ in range(5):
        s = time.perf_counter(); step(); best = min(best, time.perf_counter() - s)
    print(f"M{M}: {best*1e3:.2f} ms/step, {nbytes/best/1e9:.1f} GB/s of weights", flush=True)
