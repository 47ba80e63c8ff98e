"""Gemma3's real stack tiles at 1 row, per kind: GB/s of tm_qgemm_q8 over all 18 layers' weights
of that kind (distinct weights, in order), and the whole stack's matmuls in layer order."""
import os, time, statistics, collections, torch
from tokenmill.bench.peers.tokenmill_engine import TokenmillEngine
from tokenmill.layers import native
M = os.path.expanduser('~/.cache/tokenmill/gemma3-270m/gemma-3-270m-q4_k_m.gguf')  # tokenmill pull gemma3-270m
e = TokenmillEngine(dict(precision='gguf-q8', model_path=M, max_seq_len=1024, num_threads=2, max_num_seqs=32, prefill_len=512, kv_cache_dtype="fp16"))
m = e.llm.engine.model; lib = native.library()
seq = []
for name, mod in m.named_modules():
    if 'head' in name or 'embed' in name: continue
    for p in (mod.__dict__.get('packed') or []):
        if p.tiled is not None: seq.append((name.split('.')[-1], p.tiled))
xs = {}; ys = {}
def call(t):
    x = xs.setdefault(t.in_features, torch.randn(1, t.in_features)); y = ys.setdefault(t.out_features, torch.empty(1, t.out_features))
    lib.tm_qgemm_q8(x.data_ptr(), 1, t.in_features, t.kind, t.qw.data_ptr(), t.sc.data_ptr(),
                    t.mn.data_ptr() if t.mn is not None else 0, t.group_size, t.out_features, y.data_ptr(), 2)
groups = collections.defaultdict(list)
for n, t in seq: groups[(n, t.kind, t.group_size)].append(t)
groups[("all", -1, 0)] = [t for _, t in seq]
big = torch.empty(64 << 20, dtype=torch.uint8)
for key, ts in groups.items():
    nb = sum(t.nbytes() for t in ts); times = []
    for _ in range(15):
        big.add_(1)  # evict
        t0 = time.perf_counter()
        for t in ts: call(t)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    print(f"{key}: {len(ts)} calls {nb/1e6:.1f} MB {med*1e3:.3f} ms {nb/med/1e9:.1f} GB/s, {med/len(ts)*1e6:.1f} us/call")
