"""Interleaved A/B of kernel-library builds of the tiled q8 GEMM, loaded side by side in one
process (the box's speed moves between minutes): the working tree's sources with software
prefetch distances (0 = none), and optionally a git revision's sources (no prefetch).

    python ab_qg_builds.py --prefetch 0,2048,4096 [--kind i4|i8] [--shape K,N] [--rows 1,2,4,16]
    python ab_qg_builds.py --rev d72a2fd --prefetch 0 --rows 1,2,4,512     (old against new source)

Distinct weights (so they come from memory, as in decode), 2 threads: microseconds per call
and GOPS, medians over rounds, ratios to the first build; every build's output must be equal."""
import argparse, ctypes, os, statistics, subprocess, tempfile, time
import torch
from tokenmill.layers import native
from tokenmill.layers.quant import formats, qgemm

ap = argparse.ArgumentParser()
ap.add_argument("--rev", default=None, help="also build this revision's sources, first, without prefetch")
ap.add_argument("--prefetch", default="0", help="distances in bytes for builds of the working tree")
ap.add_argument("--kind", default="i4")
ap.add_argument("--shape", default="576,1536")
ap.add_argument("--rows", default="1,2,4,16")
ap.add_argument("--weights", type=int, default=24)
ap.add_argument("--rounds", type=int, default=5)
args = ap.parse_args()
torch.manual_seed(0); torch.set_num_threads(2)
build_dir = tempfile.mkdtemp()
sources = []
if args.rev:
    subprocess.run(f"git archive {args.rev} tokenmill/layers | tar -x -C {build_dir}", shell=True, check=True)
    sources.append((f"{args.rev} pf 0", os.path.join(build_dir, "tokenmill/layers/cpu_kernels.c"), 0))
sources += [(f"tree pf {d}", native.SOURCE, d) for d in map(int, args.prefetch.split(","))]
libs = {}
for name, source, d in sources:
    flags = native.build_flags(qg_prefetch=False) + ([f"-DTM_QG_PREFETCH={d}"] if d else [])
    libs[name] = native.declare(ctypes.CDLL(native.build_shared_library(source, build_dir + "/so", flags=flags)))
K, N = map(int, args.shape.split(","))
ws = [torch.randn(N, K) * 0.05 for _ in range(args.weights)]
tiles = [qgemm.tile(formats.quantize_int4(w, 32) if args.kind == "i4" else formats.quantize_int8(w)) for w in ws]

def run(lib, x, y):
    for t in tiles:
        lib.tm_qgemm_q8(x.data_ptr(), x.shape[0], K, t.kind, t.qw.data_ptr(), t.sc.data_ptr(),
                        t.mn.data_ptr() if t.mn is not None else None, t.group_size, N, y.data_ptr(), 2)

for m in map(int, args.rows.split(",")):
    x, y = torch.randn(m, K), torch.empty(m, N)
    times, ref = {name: [] for name in libs}, None
    for _ in range(args.rounds):
        for name, lib in libs.items():
            run(lib, x, y)
            ref = y.clone() if ref is None else ref
            assert torch.equal(y, ref), f"{name} disagrees"
            t0, n = time.perf_counter(), 0
            while time.perf_counter() - t0 < 0.25:
                run(lib, x, y); n += 1
            times[name].append((time.perf_counter() - t0) / n / len(tiles))
    first = statistics.median(next(iter(times.values())))
    print(f"{args.kind} K={K} N={N} rows {m}: " + "  ".join(
        f"{name}: {statistics.median(v) * 1e6:.1f} us {2 * m * K * N / statistics.median(v) / 1e9:.1f} GOPS "
        f"({first / statistics.median(v):.2f}x)" for name, v in times.items()), flush=True)
