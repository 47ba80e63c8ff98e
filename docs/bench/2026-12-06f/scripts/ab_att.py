"""A/B of two cpu_attention.c sources (OLD = file arg, NEW = working tree): one decode row,
SmolLM2 shape (9 q heads, 3 KV heads, D 64) or Gemma3's (4, 1, 256), fp16 cache, shuffled
blocks, at several contexts; outputs must be bit-equal. Interleaved rounds, 2 threads."""
import statistics, sys, time
import torch
from builds import library
old_src, shape = sys.argv[1], sys.argv[2]
hq, hkv, d = {"smol": (9, 3, 64), "gemma": (4, 1, 256)}[shape]
torch.manual_seed(0); torch.set_num_threads(2)
libs = {"old": library({"cpu_attention.c": open(old_src).read()}), "new": library()}
bs = 16
for ctx in (256, 1024, 2048, 4096):
    nblk = ctx // bs + 1
    # 30 layers' caches, so that K/V come from memory as in a step
    L = 30 if shape == "smol" else 18
    kc = [torch.randn(nblk + 8, bs, hkv, d).half() for _ in range(L)]
    vc = [torch.randn(nblk + 8, bs, hkv, d).half() for _ in range(L)]
    table = torch.randperm(nblk + 8)[:nblk].to(torch.int64).reshape(1, -1).contiguous()
    q = torch.randn(1, hq, d); out = torch.empty(1, hq, d)
    qs, ql, sl = torch.tensor([0]), torch.tensor([1]), torch.tensor([ctx])
    def run(lib):
        for l in range(L):
            f = lib.tm_paged_attention(q.data_ptr(), q.stride(0), hq, d, kc[l].data_ptr(), vc[l].data_ptr(), None, None,
                                       2, bs, hkv, table.data_ptr(), table.shape[1], 1, qs.data_ptr(), ql.data_ptr(),
                                       sl.data_ptr(), None, d ** -0.5, 0, out.data_ptr(), 2)
            assert not f
    res = {}
    for name, lib in libs.items():
        run(lib); res[name] = out.clone()
    assert torch.equal(res["old"], res["new"]), "outputs differ"
    times = {n: [] for n in libs}
    for _ in range(30):
        for name, lib in libs.items():
            t0 = time.perf_counter(); run(lib); times[name].append(time.perf_counter() - t0)
    o, n = statistics.median(times["old"]), statistics.median(times["new"])
    print(f"{shape} ctx {ctx}: {L} layers old {o*1e3:.3f} ms new {n*1e3:.3f} ms  new/old speed {o/n:.3f}x", flush=True)
