"""1-row tiled q8 GEMM over many distinct int4 weights (fp16 scales): microseconds a call and GB/s,
small matrices (a decode step's) against large ones."""
import time, torch, statistics
from tokenmill.layers.quant import qgemm, formats
from tokenmill.layers import native
torch.manual_seed(0); torch.set_num_threads(2)
lib = native.library()
def mk(n, k):
    p = formats.quantize_int4(torch.randn(n, k) * 0.05, 32)
    p.scales = p.scales.half(); p.mins = p.mins.half()
    return qgemm.tile(p)
def run(ts, x, y):
    for t in ts:
        lib.tm_qgemm_q8(x.data_ptr(), 1, t.in_features, t.kind, t.qw.data_ptr(), t.sc.data_ptr(),
                        t.mn.data_ptr(), t.group_size, t.out_features, y.data_ptr(), 2)
for (n, k, w) in [(16, 576, 1000), (1536, 576, 150), (576, 1536, 150), (12288, 576, 20), (49152, 576, 5)]:
    ts = [mk(n, k) for _ in range(w)]
    x, y = torch.randn(1, k), torch.empty(1, n)
    nb = sum(t.nbytes() for t in ts)
    r = []
    for _ in range(5):
        t0 = time.perf_counter(); run(ts, x, y); r.append(time.perf_counter() - t0)
    m = statistics.median(r)
    print(f"N={n} K={k} x{w}: {m/w*1e6:.1f} us/call, {nb/m/1e9:.1f} GB/s ({nb/1e6:.0f} MB)")
