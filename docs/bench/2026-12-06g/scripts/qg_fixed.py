"""Fixed cost and compute rate of tm_qgemm_q8 at one row: tiny call; each Gemma3 kind warm (same weight repeated, in L2/L3) vs cold."""
import time, statistics, torch
from tokenmill.layers import native
from tokenmill.layers.quant import formats, qgemm
torch.manual_seed(0); torch.set_num_threads(2)
lib = native.library()
def mk(n, k, kind):
    w = torch.randn(n, k) * 0.05
    if kind == "i4": p = formats.quantize_int4(w, 32)
    else: p = formats.quantize_int8(w, 32)
    return qgemm.tile(p)
def call(t, x, y):
    lib.tm_qgemm_q8(x.data_ptr(), 1, t.in_features, t.kind, t.qw.data_ptr(), t.sc.data_ptr(),
                    t.mn.data_ptr() if t.mn is not None else 0, t.group_size, t.out_features, y.data_ptr(), 2)
def bench(ts, reps=200):
    x = torch.randn(1, ts[0].in_features); y = torch.empty(1, ts[0].out_features)
    for t in ts: call(t, x, y)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for t in ts: call(t, x, y)
        times.append((time.perf_counter() - t0) / len(ts))
    return statistics.median(times)
tiny = mk(16, 32, "i4")
print(f"tiny call (16x32): {bench([tiny])*1e6:.2f} us")
for kind, n, k in (("i4", 640, 1024), ("i4", 640, 2048), ("i4", 3072, 576)):
    t = mk(n, k, kind)
    warm = bench([t])
    cold = bench([mk(n, k, kind) for _ in range(40)], reps=20)
    print(f"{kind} {n}x{k} ({t.nbytes()/1e6:.2f} MB): warm {warm*1e6:.1f} us ({t.nbytes()/warm/1e9:.1f} GB/s), cold {cold*1e6:.1f} us ({t.nbytes()/cold/1e9:.1f} GB/s)")
