# in-process A/B of decode attention builds: software prefetch off (-DTM_NO_ATT_PF), and look-ahead 6 / 12 / 24 KB (-DATT_PF_BYTES, -DATT_PF_MAX_KEYS); the macros were a temporary patch of cpu_attention.c, not kept
import ctypes, time, torch
from tokenmill.layers import native, cpu_ops
torch.set_num_threads(2)
native.library()
libs = {}
for name, extra in (("pf", []), ("nopf", ["-DTM_NO_ATT_PF"]), ("pf12k", ["-DATT_PF_BYTES=12288", "-DATT_PF_MAX_KEYS=64"]), ("pf24k", ["-DATT_PF_BYTES=24576", "-DATT_PF_MAX_KEYS=128"])):
    path = native.build_shared_library(native.SOURCE, "/tmp/ab_att_build", flags=native.build_flags() + extra)
    libs[name] = native.declare(ctypes.CDLL(path))
bs, hq, hkv, d, L = 16, 9, 3, 64, 30
for B, ctx in ((1, 512), (1, 2048), (1, 6144), (32, 192), (8, 1024)):
    nb = (ctx + bs - 1) // bs
    for dt in (torch.float32, torch.bfloat16):
        caches = [(torch.randn(B * nb, bs, hkv, d).to(dt), torch.randn(B * nb, bs, hkv, d).to(dt)) for _ in range(L)]
        bt = torch.randperm(B * nb).view(B, nb).contiguous()
        q = torch.randn(B, hq, d); out = torch.empty(B, hq, d)
        qs = torch.arange(B, dtype=torch.int64); ql = torch.ones(B, dtype=torch.int64); sl = torch.full((B,), ctx, dtype=torch.int64)
        res = {n: [] for n in libs}
        outs = {}
        for r in range(5):
            for n, lib in libs.items():
                native._status.lib = lib
                s = time.perf_counter()
                for k, v in caches:
                    cpu_ops.paged_attention(q, k, v, bt, qs, ql, sl, 0.125, None, out)
                res[n].append(time.perf_counter() - s); outs[n] = out.clone()
        nbytes = 2 * L * B * ctx * hkv * d * (4 if dt == torch.float32 else 2)
        print(f"B{B} ctx{ctx} {str(dt)[6:]}: " + "  ".join(f"{n} {sorted(v)[2]*1e3:.2f} ms ({nbytes/sorted(v)[2]/1e9:.1f} GB/s)" for n, v in res.items()), flush=True)
