import time, torch
from tokenmill.layers import cpu_ops, native
torch.set_num_threads(2)
lib = native.library()
def t(f, n=20):
    f(); f(); best = 1e9
    for _ in range(7):
        s = time.perf_counter()
        for _ in range(n): f()
        best = min(best, (time.perf_counter() - s) / n)
    return best
for (N, K) in [(262144, 640), (49152, 576), (2048, 640), (640, 2048)]:
    w = torch.randn(N, K) * 0.05; tiles = cpu_ops.bf16_tiles(w); del w
    for M in [1, 2]:
        x = torch.randn(M, K)
        res = {}
        for r in range(3):
            for on in (0, 1):
                lib.tm_amx_enable(on); res.setdefault(on, []).append(t(lambda: cpu_ops.linear_bf16(x, tiles, None), 5 if N > 1e5 else 50))
        a, b = min(res[0]), min(res[1])
        print(f"N{N} K{K} M{M}: avx512 {a*1e6:.0f} us ({N*K*2/a/1e9:.1f} GB/s)  amx {b*1e6:.0f} us ({N*K*2/b/1e9:.1f} GB/s)  amx/avx512 {b/a:.3f}", flush=True)
lib.tm_amx_enable(1)
