"""The fixed cost of one tm_qgemm_q8 call (one 16-row tile) through ctypes, 1 thread and 2."""
import time, torch
from tokenmill.layers.quant import qgemm, formats
from tokenmill.layers import native
torch.manual_seed(0); torch.set_num_threads(2)
lib = native.library()
p = formats.quantize_int4(torch.randn(16, 576) * 0.05, 32); p.scales = p.scales.half(); p.mins = p.mins.half()
t = qgemm.tile(p); x, y = torch.randn(1, 576), torch.empty(1, 16)
args = (x.data_ptr(), 1, 576, t.kind, t.qw.data_ptr(), t.sc.data_ptr(), t.mn.data_ptr(), 32, 16, y.data_ptr())
f = lib.tm_qgemm_q8
for nt in (1, 2, 1, 2):
    t0 = time.perf_counter()
    for _ in range(20000): f(*args, nt)
    print(nt, (time.perf_counter() - t0) / 20000 * 1e6, "us")
