"""Interleaved A/B of the tiled q8 GEMM's software prefetch distance, several kernel-library
builds loaded side by side in one process (the box's speed moves between minutes).

    python ab_qg_prefetch.py [--kind i4|i8] [--distances 0,1024,2048,4096] [--rounds 7]

24 distinct SmolLM2-shaped weights (so they come from memory, as in decode), 1 / 2 / 4 / 16
rows, 2 threads: microseconds per call, medians over rounds."""
import argparse, ctypes, statistics, time
import torch
from tokenmill.layers import native
from tokenmill.layers.quant import formats, qgemm

ap = argparse.ArgumentParser()
ap.add_argument("--kind", default="i4")
ap.add_argument("--distances", default="0,1024,2048,4096")
ap.add_argument("--rounds", type=int, default=7)
ap.add_argument("--shape", default="576,1536")
ap.add_argument("--rows", default="1,2,4,16")
args = ap.parse_args()
torch.manual_seed(0); torch.set_num_threads(2)
libs = {}
for d in map(int, args.distances.split(",")):
    flags = native.build_flags(qg_prefetch=False) + ([f"-DTM_QG_PREFETCH={d}"] if d else [])
    libs[d] = native.declare(ctypes.CDLL(native.build_shared_library(native.SOURCE, flags=flags)))
K, N = map(int, args.shape.split(","))
ws = [torch.randn(N, K) * 0.05 for _ in range(24)]
tiles = [qgemm.tile(formats.quantize_int4(w, 32) if args.kind == "i4" else formats.quantize_int8(w)) for w in ws]

def run(lib, x, y):
    for t in tiles:
        lib.tm_qgemm_q8(x.data_ptr(), x.shape[0], K, t.kind, t.qw.data_ptr(), t.sc.data_ptr(),
                        t.mn.data_ptr() if t.mn is not None else None, t.group_size, N, y.data_ptr(), 2)

for m in map(int, args.rows.split(",")):
    x, y = torch.randn(m, K), torch.empty(m, N)
    ref = None
    times = {d: [] for d in libs}
    for r in range(args.rounds):
        for d, lib in libs.items():
            run(lib, x, y)
            if ref is None: ref = y.clone()
            assert torch.equal(y, ref), "builds disagree"
            t0 = time.perf_counter(); n = 0
            while time.perf_counter() - t0 < 0.25:
                run(lib, x, y); n += 1
            times[d].append((time.perf_counter() - t0) / n / len(tiles) * 1e6)
    base = statistics.median(times[min(libs)])
    print(f"{args.kind} K={K} N={N} rows {m}: " + "  ".join(
        f"pf {d}: {statistics.median(v):.1f} us ({base / statistics.median(v):.2f}x)" for d, v in times.items()), flush=True)
