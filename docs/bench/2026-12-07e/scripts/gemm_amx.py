import time, torch, torch.nn.functional as F
from tokenmill.layers import cpu_ops, native
torch.set_num_threads(2)
lib = native.library()
def t(f, n=30):
    f(); f()
    best = 1e9
    for _ in range(5):
        s = time.perf_counter()
        for _ in range(n): f()
        best = min(best, (time.perf_counter() - s) / n)
    return best
for (N, K) in [(1536, 576), (576, 1536), (960, 576), (49152, 576), (4096, 4096)]:
    w = torch.randn(N, K) * 0.05
    tiles = cpu_ops.bf16_tiles(w)
    wb = w.bfloat16()
    for M in [1, 4, 8, 16, 32, 64, 128, 512]:
        if N * K > 2e7 and M > 64: continue
        x = torch.randn(M, K)
        xb = x.bfloat16()
        lib.tm_amx_enable(0); a = t(lambda: cpu_ops.linear_bf16(x, tiles, None))
        lib.tm_amx_enable(1); b = t(lambda: cpu_ops.linear_bf16(x, tiles, None))
        c = t(lambda: F.linear(xb, wb))
        fl = 2 * M * N * K
        print(f"N{N} K{K} M{M}: avx512 {fl/a/1e9:7.1f} GF/s  amx {fl/b/1e9:7.1f}  torch-bf16 {fl/c/1e9:7.1f}  (amx {b*1e6:.0f} us)")
