# decode attention at B sequences x ctx keys, SmolLM2's heads (9 q / 3 kv, D 64), 30 layers' worth of caches
import sys, time, torch
from tokenmill.layers import cpu_ops
torch.set_num_threads(2)
B, ctx, L = int(sys.argv[1]), int(sys.argv[2]), 30
bs, hq, hkv, d = 16, 9, 3, 64
nb = (ctx + bs - 1) // bs
for dt in (torch.float32, torch.bfloat16):
    caches = [(torch.randn(B * nb, bs, hkv, d).to(dt), torch.randn(B * nb, bs, hkv, d).to(dt)) for _ in range(L)]
    perm = torch.randperm(B * nb)
    bt = perm.view(B, nb).contiguous()
    q = torch.randn(B, hq, d); out = torch.empty(B, hq, d)
    qs = torch.arange(B, dtype=torch.int64); ql = torch.ones(B, dtype=torch.int64); sl = torch.full((B,), ctx, dtype=torch.int64)
    def step():
        for k, v in caches:
            cpu_ops.paged_attention(q, k, v, bt, qs, ql, sl, 0.125, None, out)
    step()
    best = 1e9
    for _ in range(5):
        s = time.perf_counter(); step(); best = min(best, time.perf_counter() - s)
    nbytes = 2 * L * B * ctx * hkv * d * (4 if dt == torch.float32 else 2)
    print(f"{dt} B{B} ctx{ctx}: {best*1e3:.2f} ms/step ({nbytes/best/1e9:.1f} GB/s of K/V)", flush=True)
