"""tm_paged_attention with Gemma3 heads (4 q, 1 kv, D 256), fp16 cache, one row, ctx 128..512, 18 layers' caches:
cold (cache evicted before each pass of 18 calls), warm (same layer repeated), threads 1/2."""
import time, statistics, torch
from tokenmill.layers import native
lib = native.library()
hq, hkv, d, bs = 4, 1, 256, 16
big = torch.empty(64 << 20, dtype=torch.uint8)
for ctx in (128, 256, 512):
    nblk = ctx // bs + 1; L = 18
    kc = [torch.randn(nblk + 8, bs, hkv, d).half() for _ in range(L)]
    vc = [torch.randn(nblk + 8, bs, hkv, d).half() for _ in range(L)]
    table = torch.randperm(nblk + 8)[:nblk].to(torch.int64).reshape(1, -1).contiguous()
    q = torch.randn(1, hq, d); out = torch.empty(1, hq, d)
    qs, ql, sl = torch.tensor([0]), torch.tensor([1]), torch.tensor([ctx])
    def run(layers, nt):
        for l in layers:
            lib.tm_paged_attention(q.data_ptr(), hq * d, hq, d, kc[l].data_ptr(), vc[l].data_ptr(), None, None,
                                   2, bs, hkv, table.data_ptr(), table.shape[1], 1, qs.data_ptr(), ql.data_ptr(),
                                   sl.data_ptr(), None, d ** -0.5, 0, out.data_ptr(), nt)
    res = []
    for label, layers, evict in (("cold", range(L), True), ("warm", [0] * L, False)):
        for nt in (1, 2):
            ts = []
            for _ in range(30):
                if evict: big.add_(1)
                t0 = time.perf_counter(); run(layers, nt); ts.append(time.perf_counter() - t0)
            res.append(f"{label} t{nt} {statistics.median(ts)/L*1e6:.1f}")
    print(f"ctx {ctx}: us per layer call: " + ", ".join(res))
t0 = time.perf_counter()
for _ in range(1000): lib.tm_paged_attention(q.data_ptr(), hq * d, hq, d, kc[0].data_ptr(), vc[0].data_ptr(), None, None, 2, bs, hkv, table.data_ptr(), table.shape[1], 1, qs.data_ptr(), ql.data_ptr(), torch.tensor([1]).data_ptr(), None, d ** -0.5, 0, out.data_ptr(), 2)
print(f"ctx 1 call: {(time.perf_counter()-t0)*1e3:.1f} us")
