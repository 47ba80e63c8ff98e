"""tm_qgemm_q8 of two libraries on the same random tiles: identical outputs over kinds, group
sizes, rows and threads."""
import ctypes, sys, numpy as np
libs = [ctypes.CDLL(p) for p in sys.argv[1:3]]
for l in libs:
    l.tm_qgemm_q8.restype = ctypes.c_int
    l.tm_qgemm_q8.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
rng = np.random.default_rng(0)
P = lambda a: a.ctypes.data
cases = 0
for kind in (0, 1, 3, 8, 9, 11):
    base = kind & 7
    for G in ((16, 32) if base == 0 else (32, 64, 128)):
        for mins in ((False,) if G == 16 else (False, True)):
            for N in (16, 40, 576):
                K = 384
                nb, ng, tiles = K // 32, K // G, (N + 15) // 16
                width = {0: 512, 1: 256, 3: 320}[base]
                qw = rng.integers(0, 256, size=tiles * nb * width, dtype=np.uint8)
                sdt = np.float16 if kind & 8 else np.float32
                sc = (rng.random(tiles * ng * 16) * 0.02).astype(sdt)
                mn = (rng.random(tiles * ng * 16) * -0.05).astype(sdt) if mins else None
                for M in (0, 1, 2, 3, 4, 5, 8, 9, 13, 20):
                    x = rng.standard_normal((max(M, 1), K)).astype(np.float32)
                    for nt in (1, 2, 3):
                        outs = []
                        for l in libs:
                            y = np.full((max(M, 1), N), 7.0, dtype=np.float32)
                            rc = l.tm_qgemm_q8(P(x), M, K, kind, P(qw), P(sc), None if mn is None else P(mn), G, N, P(y), nt)
                            outs.append((rc, y))
                        assert outs[0][0] == outs[1][0] == 0
                        assert np.array_equal(outs[0][1], outs[1][1]), (kind, G, mins, N, M, nt)
                        cases += 1
print("identical:", cases, "cases")
