"""Interleaved A/B of the tiled q8 GEMM between the kernel sources of a git revision and the
working tree (both built without the software prefetch), loaded side by side in one process.

    python ab_qg_source.py REV [--kind i4] [--shape K,N] [--rows 1,4,16,64] [--rounds 5]"""
import argparse, ctypes, os, statistics, subprocess, tempfile, time
import torch
from tokenmill.layers import native
from tokenmill.layers.quant import formats, qgemm

ap = argparse.ArgumentParser()
ap.add_argument("rev")
ap.add_argument("--kind", default="i4")
ap.add_argument("--shape", default="576,1536")
ap.add_argument("--rows", default="1,4,16,64,512")
ap.add_argument("--rounds", type=int, default=5)
args = ap.parse_args()
torch.manual_seed(0); torch.set_num_threads(2)
old_dir = tempfile.mkdtemp()
subprocess.run(f"git archive {args.rev} tokenmill/layers | tar -x -C {old_dir}", shell=True, check=True)
flags = native.build_flags(qg_prefetch=False)
libs = {"old": os.path.join(old_dir, "tokenmill/layers/cpu_kernels.c"), "new": native.SOURCE}
libs = {k: native.declare(ctypes.CDLL(native.build_shared_library(v, build_dir=old_dir + "/build", flags=flags)))
        for k, v in libs.items()}
K, N = map(int, args.shape.split(","))
ws = [torch.randn(N, K) * 0.05 for _ in range(8)]
tiles = [qgemm.tile(formats.quantize_int4(w, 32) if args.kind == "i4" else formats.quantize_int8(w)) for w in ws]

def run(lib, x, y):
    for t in tiles:
        lib.tm_qgemm_q8(x.data_ptr(), x.shape[0], K, t.kind, t.qw.data_ptr(), t.sc.data_ptr(),
                        t.mn.data_ptr() if t.mn is not None else None, t.group_size, N, y.data_ptr(), 2)

for m in map(int, args.rows.split(",")):
    x, y = torch.randn(m, K), torch.empty(m, N)
    times, ref = {k: [] for k in libs}, None
    for r in range(args.rounds):
        for k, lib in libs.items():
            run(lib, x, y)
            ref = y.clone() if ref is None else ref
            assert torch.equal(y, ref), "sources disagree"
            t0 = time.perf_counter(); n = 0
            while time.perf_counter() - t0 < 0.2:
                run(lib, x, y); n += 1
            times[k].append((time.perf_counter() - t0) / n / len(tiles))
    gops = {k: 2 * m * K * N / statistics.median(v) / 1e9 for k, v in times.items()}
    print(f"{args.kind} K={K} N={N} rows {m}: old {gops['old']:.1f} GOPS, new {gops['new']:.1f} GOPS "
          f"({gops['new'] / gops['old']:.2f}x)", flush=True)
