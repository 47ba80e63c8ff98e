"""python warm_kinds.py [ROWS]: each kind of Gemma 3 270m's stack tiles (its first layer of that kind)
called again and again (in cache). ROWS 1 (default): the one-row rate in GB/s of tiles ("net": less
~6 us of ctypes and call); more rows: GOPS."""
import os, sys, time, statistics, torch
from tokenmill.layers import native
from tokenmill.bench.peers.tokenmill_engine import TokenmillEngine
ROWS = int(sys.argv[1]) if len(sys.argv) > 1 else 1
M = os.path.expanduser('~/.cache/tokenmill/gemma3-270m/gemma-3-270m-q4_k_m.gguf')  # tokenmill pull gemma3-270m
e = TokenmillEngine(dict(precision='gguf-q8', model_path=M, max_seq_len=1024, num_threads=2, max_num_seqs=32, prefill_len=512, kv_cache_dtype="fp16"))
m = e.llm.engine.model; lib = native.library()
seen = {}
for name, mod in m.named_modules():
    if 'head' in name or 'embed' in name: continue
    for p in (mod.__dict__.get('packed') or []):
        t = p.tiled
        if t is not None: seen.setdefault((name.split('.')[-1], t.kind, t.group_size), t)
for key, t in seen.items():
    x = torch.randn(ROWS, t.in_features); y = torch.empty(ROWS, t.out_features)
    def call(): lib.tm_qgemm_q8(x.data_ptr(), ROWS, t.in_features, t.kind, t.qw.data_ptr(), t.sc.data_ptr(),
                    t.mn.data_ptr() if t.mn is not None else 0, t.group_size, t.out_features, y.data_ptr(), 2)
    call(); ts = []
    for _ in range(300 if ROWS == 1 else 10):
        t0 = time.perf_counter(); call(); ts.append(time.perf_counter() - t0)
    md = statistics.median(ts)
    if ROWS == 1:
        print(f"{key} {t.out_features}x{t.in_features} {t.nbytes()/1e6:.2f} MB: warm {md*1e6:.1f} us {t.nbytes()/md/1e9:.1f} GB/s (net of 6us: {t.nbytes()/(md-6e-6)/1e9:.1f})")
    else:
        print(f"{key} {t.out_features}x{t.in_features}: {md*1e3:.2f} ms {2*ROWS*t.out_features*t.in_features/md/1e9:.0f} GOPS")
