"""A/B of two kernel-library sources (OLD given as a file, NEW = working tree) on a decode-like
sequence: 30 layers of SmolLM2 shapes (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536),
Q4_1-like int4 tiles with fp16 scales / mins, distinct weights, 1 row, 2 threads. Interleaved."""
import os, statistics, sys, time
import torch
from builds import library
from tokenmill.layers.quant import formats, qgemm
old_src = sys.argv[1]; rows = int(sys.argv[2]) if len(sys.argv) > 2 else 1
torch.manual_seed(0); torch.set_num_threads(2)
libs = {"old": library({"quant/qgemm.c": open(old_src).read()}), "new": library()}
def mk(n, k):
    p = formats.quantize_int4(torch.randn(n, k) * 0.05, 32); p.scales = p.scales.half(); p.mins = p.mins.half()
    return qgemm.tile(p)
seq = [mk(n, k) for _ in range(30) for (n, k) in ((960, 576), (576, 576), (3072, 576), (576, 1536))]
xs = {k: torch.randn(rows, k) for k in (576, 1536)}; ys = {n: torch.empty(rows, n) for n in (960, 576, 3072)}
nbytes = sum(t.nbytes() for t in seq)
def run(lib):
    for t in seq:
        lib.tm_qgemm_q8(xs[t.in_features].data_ptr(), rows, t.in_features, t.kind, t.qw.data_ptr(), t.sc.data_ptr(),
                        t.mn.data_ptr(), t.group_size, t.out_features, ys[t.out_features].data_ptr(), 2)
outs = {}
for name, lib in libs.items():
    run(lib); outs[name] = {n: y.clone() for n, y in ys.items()}
assert all(torch.equal(outs["old"][n], outs["new"][n]) for n in ys)
times = {n: [] for n in libs}
for _ in range(int(os.environ.get("ROUNDS", 40))):
    for name, lib in libs.items():
        t0 = time.perf_counter(); run(lib); times[name].append(time.perf_counter() - t0)
o, n = statistics.median(times["old"]), statistics.median(times["new"])
print(f"rows {rows}: {nbytes/1e6:.0f} MB in 120 calls: old {o*1e3:.3f} ms ({nbytes/o/1e9:.1f} GB/s), new {n*1e3:.3f} ms ({nbytes/n/1e9:.1f} GB/s): new/old speed {o/n:.3f}x")
