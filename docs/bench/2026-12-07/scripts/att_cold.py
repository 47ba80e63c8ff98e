"""tm_paged_attention over L layers' caches in turn (cold: the caches exceed L3), one row, fp16."""
import time, torch
from tokenmill.layers import native
from tokenmill.bench.common import measure_read_bandwidth_gbps
def setup(hq, hkv, d, ctx, L, bs=16, dt="f16"):
    nblk = ctx // bs + 1
    tdt = torch.float16 if dt == "f16" else torch.float32
    kc = [torch.randn(nblk + 8, bs, hkv, d).to(tdt) for _ in range(L)]
    vc = [torch.randn(nblk + 8, bs, hkv, d).to(tdt) for _ in range(L)]
    table = torch.randperm(nblk + 8)[:nblk].to(torch.int64).reshape(1, -1).contiguous()
    q = torch.randn(1, hq, d); out = torch.empty(1, hq, d)
    keep = (kc, vc, table, q, out, torch.tensor([0]), torch.tensor([1]), torch.tensor([ctx]))
    calls = [(q.data_ptr(), hq * d, hq, d, kc[l].data_ptr(), vc[l].data_ptr(), None, None, 2 if dt == "f16" else 0, bs, hkv,
              table.data_ptr(), table.shape[1], 1, keep[5].data_ptr(), keep[6].data_ptr(), keep[7].data_ptr(), None,
              d ** -0.5, 0, out.data_ptr(), 2) for l in range(L)]
    return keep, calls, 2 * ctx * hkv * d * (2 if dt == "f16" else 4) * L
def timeit(lib, calls, reps=5):
    f = lib.tm_paged_attention; best = 1e9
    for _ in range(reps):
        t0 = time.perf_counter()
        for a in calls: f(*a)
        best = min(best, time.perf_counter() - t0)
    return best
if __name__ == "__main__":
    lib = native.library()
    for name, shape in (("smollm2", (9, 3, 64, 8120, 30)), ("smollm2-2k", (9, 3, 64, 2048, 30)), ("gemma3-global", (4, 1, 256, 4096, 12)), ("gemma3-512", (4, 1, 256, 512, 18))):
        keep, calls, nbytes = setup(*shape)
        t = timeit(lib, calls)
        print(f"{name}: {t*1e3:.2f} ms per pass of {shape[4]} layers, {nbytes/t/1e9:.1f} GB/s; {t/shape[4]*1e6:.0f} us/layer", flush=True)
    print("read bw", measure_read_bandwidth_gbps())
