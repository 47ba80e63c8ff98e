# in-process A/B of AMX weight prefetch distances (-DTM_AMX_PF=D, a temporary patch of amx_block, not kept): 30 layers of SmolLM2 streamed
import ctypes, sys, time, torch
from tokenmill.layers import native, cpu_ops
torch.set_num_threads(2)
libs = {}
for d in [None] + [int(a) for a in sys.argv[1:]]:
    flags = native.build_flags() + ([f"-DTM_AMX_PF={d}"] if d else [])
    path = native.build_shared_library(native.SOURCE, "/tmp/ab_pf_build", flags=flags)
    lib = native.declare(ctypes.CDLL(path)); assert lib.tm_amx_enable(1) == 0
    libs[d] = lib
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
layers = [[cpu_ops.bf16_tiles(torch.randn(n, k) * 0.05) for n, k in shapes] for _ in range(30)]
nbytes = sum(t.numel() * 2 for l in layers for t in l)
for M in (1, 8, 32, 64):
    xs = {k: torch.randn(M, k) for k in (576, 1536)}
    ys = {n: torch.empty(M, n) for n, _ in shapes}
    res = {d: [] for d in libs}
    for r in range(5):
        for d, lib in libs.items():
            s = time.perf_counter()
            for l in layers:
                for t in l:
                    n, k = t.shape[0] * 16, t.shape[1] * 2
                    lib.tm_linear_bf16(xs[k].data_ptr(), M, k, t.data_ptr(), n, None, ys[n].data_ptr(), 2)
            res[d].append(time.perf_counter() - s)
    print(f"M{M}: " + "  ".join(f"pf={d}: {sorted(v)[2]*1e3:.2f} ms ({nbytes/sorted(v)[2]/1e9:.1f} GB/s)" for d, v in res.items()), flush=True)
