"""Time of each gguf-q8 linear of a model's layers at M rows (tm_qgemm_q8 on the model's own
tiles, cache-warm) against torch.mm of a float32 weight of the same shape, summed by kind:
python per_linear.py MODEL.gguf M."""
import collections, sys, time
import torch
from tokenmill.bench.peers.tokenmill_engine import TokenmillEngine
from tokenmill.layers.quant import qgemm
torch.set_num_threads(2)
model = sys.argv[1]; M = int(sys.argv[2])
e = TokenmillEngine(dict(precision="gguf-q8", model_path=model, max_seq_len=M + 16, num_threads=2,
                         max_num_seqs=1, prefill_len=M, kv_cache_dtype="fp16"))
m = e.llm.engine.model if hasattr(e.llm.engine, "model") else None
if m is None:
    import gc
    from torch import nn
    m = [o for o in gc.get_objects() if isinstance(o, nn.Module) and hasattr(o, "layers")][0]
agg = collections.defaultdict(lambda: [0.0, 0.0, 0])
seen = 0
for name, mod in m.named_modules():
    parts = getattr(mod, "packed", None)
    if not isinstance(parts, list) or "layers." not in name: continue
    for p in parts:
        t = p.tiled
        if t is None: continue
        x = torch.randn(M, p.in_features)
        kind = f"{p.kind} g{p.group_size} mins={p.mins is not None} tk={t.kind} K={p.in_features} N={p.out_features}"
        qgemm.qgemm_q8(x, t)
        R = max(1, 2048 // M)
        t0 = time.perf_counter()
        for _ in range(R): qgemm.qgemm_q8(x, t)
        tq = (time.perf_counter() - t0) / R
        w = torch.randn(p.out_features, p.in_features)
        torch.mm(x, w.t()); t0 = time.perf_counter()
        for _ in range(R): torch.mm(x, w.t())
        tf = (time.perf_counter() - t0) / R
        a = agg[kind]; a[0] += tq; a[1] += tf; a[2] += 1
tq = tf = 0
for k, (q, f, n) in sorted(agg.items()):
    K = int(k.split("K=")[1].split()[0]); N = int(k.split("N=")[1])
    print(f"{k} x{n}: q8 {q*1e3:.1f} ms ({2*M*K*N*n/q/1e9:.0f} GOPS)  fp32 {f*1e3:.1f} ms ({2*M*K*N*n/f/1e9:.0f})")
    tq += q; tf += f
print(f"total q8 {tq*1e3:.0f} ms fp32 {tf*1e3:.0f} ms")
