# usage: python abh.py LIB...: float32 tm_linear_blocked vs tm_linear_half on bf16 weights (MS=32,64), W from memory, GFLOP/s
import sys, time, ctypes, torch, os
torch.set_num_threads(2)
libs = [ctypes.CDLL(p) for p in sys.argv[1:]]
sys.path.insert(0, os.environ.get("TREE", "/work/main"))
from tokenmill.layers import cpu_ops
BF = cpu_ops.HALF_WEIGHT_CODES[torch.bfloat16] if hasattr(cpu_ops, "HALF_WEIGHT_CODES") else 2
for l in libs:
    f = l.tm_linear_blocked; f.restype = None
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    g = l.tm_linear_half; g.restype = None
    g.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
ms = [int(a) for a in os.environ.get("MS", "32").split(",")]
for m in ms:
  for (n, k, name) in [(960,576,"qkv"),(576,576,"o"),(3072,576,"gate_up"),(576,1536,"down"),(49152,576,"head")]:
    copies = max(1, (256 << 20) // (n * k * 4))
    ws = [torch.randn(n, k) for _ in range(copies)]
    hs = [w.to(torch.bfloat16) for w in ws]
    x = torch.randn(m, k); y = torch.empty(m, n)
    res = []
    for l in libs:
        best = [0, 0]
        for r in range(5):
            t = time.perf_counter()
            for w in ws: l.tm_linear_blocked(x.data_ptr(), m, k, w.data_ptr(), n, None, y.data_ptr(), 2)
            best[0] = max(best[0], 2*m*n*k*copies/(time.perf_counter()-t)/1e9)
            t = time.perf_counter()
            for w in hs: l.tm_linear_half(x.data_ptr(), m, k, w.data_ptr(), BF, n, None, y.data_ptr(), 2)
            best[1] = max(best[1], 2*m*n*k*copies/(time.perf_counter()-t)/1e9)
        res.append("f32 %.0f bf16w %.0f" % tuple(best))
    print(m, name, " | ".join(res), flush=True)
