"""Prefill attention, a git revision's kernel library against this tree's, side by side:
Gemma3-270m's shape (4 query heads, 1 KV head, head 256), one request, the last CHUNK rows of
a CTX-token context, fp16 / fp32 cache, window W (0 = none). Outputs asserted equal."""
import ctypes, statistics, subprocess, sys, tempfile, time, torch
from tokenmill.layers import native
torch.manual_seed(0); torch.set_num_threads(2)
rev = sys.argv[1]; ctx = int(sys.argv[2]); chunk = int(sys.argv[3]); dtype = getattr(torch, sys.argv[4]); win = int(sys.argv[5])
d = tempfile.mkdtemp()
subprocess.run(f"git archive {rev} tokenmill/layers | tar -x -C {d}", shell=True, check=True)
flags = native.build_flags()
libs = {"old": native.declare(ctypes.CDLL(native.build_shared_library(f"{d}/tokenmill/layers/cpu_kernels.c", d + "/so", flags=flags))),
        "new": native.declare(ctypes.CDLL(native.build_shared_library(native.SOURCE, d + "/so2", flags=flags)))}
Hq, Hkv, D, bs = 4, 1, 256, 16
nblk = ctx // bs
k = torch.randn(nblk, bs, Hkv, D).to(dtype); v = torch.randn(nblk, bs, Hkv, D).to(dtype)
perm = torch.randperm(nblk)
table = perm.view(1, -1).contiguous()
q = torch.randn(chunk, Hq, D)
from tokenmill.layers import cpu_ops
kcode = cpu_ops._cache_parts(k)[2]
qs = torch.tensor([0]); ql = torch.tensor([chunk]); sl = torch.tensor([ctx])
outs = {}
def run(name):
    out = torch.empty(chunk, Hq, D)
    r = libs[name].tm_prefill_attention(q.data_ptr(), q.stride(0), Hq, D, k.data_ptr(), v.data_ptr(), None, None,
                                        kcode, bs, Hkv, table.data_ptr(), table.stride(0), 1, qs.data_ptr(),
                                        ql.data_ptr(), sl.data_ptr(), 1 / 16, win, out.data_ptr(), 2)
    assert r == 0
    return out
res = {n: [] for n in libs}
for _ in range(4):
    for n in libs:
        o = run(n)
        if "ref" not in outs: outs["ref"] = o
        assert torch.equal(o, outs["ref"]), n
        t0 = time.perf_counter(); run(n); res[n].append(time.perf_counter() - t0)
keys = sum(min(p + 1, win or p + 1) for p in range(ctx - chunk, ctx))
fl = keys * Hq * D * 4
o, nw = statistics.median(res["old"]), statistics.median(res["new"])
print(f"ctx {ctx} chunk {chunk} {sys.argv[4]} win {win}: old {o*1e3:.1f} ms {fl/o/1e9:.0f} GFLOP/s  new {nw*1e3:.1f} ms {fl/nw/1e9:.0f} GFLOP/s ({o/nw:.2f}x)")
