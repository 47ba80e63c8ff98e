"""The 5-bit tiles of a git revision (its qgemm.py tiles, its kernels) against this tree's,
loaded side by side, each build on its own tiles of the same random weights (outputs asserted
equal), interleaved over 5 rounds, 2 threads, 12 distinct weights:
    python ab_i5.py REV K,N ROWS [mins]      e.g. ab_i5.py 17704f8 640,4096 1,2,4,16,512"""
import ctypes, importlib.util, statistics, subprocess, sys, tempfile, time, torch
from tokenmill.layers import native
from tokenmill.layers.quant import formats, qgemm
torch.manual_seed(0); torch.set_num_threads(2)
rev = sys.argv[1]; K, N = map(int, sys.argv[2].split(",")); rows = list(map(int, sys.argv[3].split(",")))
mins = len(sys.argv) > 4 and sys.argv[4] == "mins"
d = tempfile.mkdtemp()
subprocess.run(f"git archive {rev} tokenmill/layers | tar -x -C {d}", shell=True, check=True)
spec = importlib.util.spec_from_file_location("old_qgemm", f"{d}/tokenmill/layers/quant/qgemm.py")
old = importlib.util.module_from_spec(spec); sys.modules["old_qgemm"] = old; spec.loader.exec_module(old)
flags = native.build_flags()
libs = {"old": native.declare(ctypes.CDLL(native.build_shared_library(f"{d}/tokenmill/layers/cpu_kernels.c", d + "/so", flags=flags))),
        "new": native.declare(ctypes.CDLL(native.build_shared_library(native.SOURCE, d + "/so2", flags=flags)))}
W = 12
ps = []
for _ in range(W):
    off = 0 if mins else 16
    q = torch.randint(-off, 32 - off, (N, K), dtype=torch.int8)
    sc = (torch.rand(N, K // 32) * 0.01).half()
    mn = (torch.randn(N, K // 32) * 0.01).half() if mins else None
    ps.append(formats.Packed("i8", q, sc, mn, 32, N, K))
tiles = {"old": [old.tile(p) for p in ps], "new": [qgemm.tile(p) for p in ps]}
assert all(t.kind & 7 == 3 for t in tiles["new"])
def run(name, x, y):
    lib = libs[name]
    for t in tiles[name]:
        lib.tm_qgemm_q8(x.data_ptr(), x.shape[0], K, t.kind, t.qw.data_ptr(), t.sc.data_ptr(),
                        t.mn.data_ptr() if t.mn is not None else None, t.group_size, N, y.data_ptr(), 2)
for m in rows:
    x = torch.randn(m, K); y = torch.empty(m, N); ref = None
    times = {k: [] for k in libs}
    for _ in range(5):
        for name in libs:
            run(name, x, y)
            if ref is None: ref = y.clone()
            assert torch.equal(ref, y), name
            t0 = time.perf_counter(); n = 0
            while time.perf_counter() - t0 < 0.25: run(name, x, y); n += 1
            times[name].append((time.perf_counter() - t0) / n / W)
    o, nw = statistics.median(times["old"]), statistics.median(times["new"])
    print(f"i5{' mins' if mins else ''} K={K} N={N} rows {m}: old {2*m*K*N/o/1e9:.0f} GOPS new {2*m*K*N/nw/1e9:.0f} GOPS ({o/nw:.2f}x)", flush=True)
