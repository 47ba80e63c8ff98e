"""Decode attention (tm_paged_attention, one row, SmolLM2 heads, fp16 cache, 30 layers' caches) at
contexts 2048 / 4096: 1 thread against 2, and one layer's cache repeated (cache-warm)."""
import time, statistics, torch
from tokenmill.layers import native
lib = native.library()
hq, hkv, d, bs = 9, 3, 64, 16
for ctx in (2048, 4096):
    nblk = ctx // bs + 1; L = 30
    kc = [torch.randn(nblk + 8, bs, hkv, d).half() for _ in range(L)]
    vc = [torch.randn(nblk + 8, bs, hkv, d).half() for _ in range(L)]
    table = torch.randperm(nblk + 8)[:nblk].to(torch.int64).reshape(1, -1).contiguous()
    q = torch.randn(1, hq, d); out = torch.empty(1, hq, d)
    qs, ql, sl = torch.tensor([0]), torch.tensor([1]), torch.tensor([ctx])
    for nt in (1, 2, 1, 2):
        ts = []
        for _ in range(10):
            t0 = time.perf_counter()
            for l in range(L):
                lib.tm_paged_attention(q.data_ptr(), q.stride(0), hq, d, kc[l].data_ptr(), vc[l].data_ptr(), None, None,
                                       2, bs, hkv, table.data_ptr(), table.shape[1], 1, qs.data_ptr(), ql.data_ptr(),
                                       sl.data_ptr(), None, d ** -0.5, 0, out.data_ptr(), nt)
            ts.append(time.perf_counter() - t0)
        m = statistics.median(ts); kvb = ctx * hkv * d * 2 * 2 * L
        print(f"ctx {ctx} threads {nt}: {m*1e3:.2f} ms, {kvb/m/1e9:.1f} GB/s")
    # hot: same layer repeated (fits L2/L3?)
    ts = []
    for _ in range(10):
        t0 = time.perf_counter()
        for l in range(L):
            lib.tm_paged_attention(q.data_ptr(), q.stride(0), hq, d, kc[0].data_ptr(), vc[0].data_ptr(), None, None,
                                   2, bs, hkv, table.data_ptr(), table.shape[1], 1, qs.data_ptr(), ql.data_ptr(),
                                   sl.data_ptr(), None, d ** -0.5, 0, out.data_ptr(), 2)
        ts.append(time.perf_counter() - t0)
    print(f"ctx {ctx} one layer's cache repeated (cache-warm): {statistics.median(ts)*1e3:.2f} ms")
