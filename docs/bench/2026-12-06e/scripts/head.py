"""The tied head of a gguf-q8 model alone (tm_qgemm_q8 on its tiles, caches flushed by
writing 200 MB before each call) at 1-8 rows, and torch reading the same tiles:
python head.py MODEL.gguf."""
import sys, time, statistics, torch
from tokenmill.bench.peers.tokenmill_engine import TokenmillEngine
from tokenmill.layers.quant import qgemm
torch.set_num_threads(2)
e = TokenmillEngine(dict(precision="gguf-q8", model_path=sys.argv[1], max_seq_len=600, num_threads=2,
                         max_num_seqs=1, prefill_len=128, kv_cache_dtype="fp16"))
import gc
from torch import nn
heads = [(n, m) for o in gc.get_objects() if isinstance(o, nn.Module) and hasattr(o, "layers") for n, m in o.named_modules()
         if getattr(m, "packed", None) is not None and "layers." not in n]
print([(n, type(m).__name__) for n, m in heads])
n, m = heads[0]; p = m.packed[0] if isinstance(m.packed, list) else m.packed; t = p.tiled
print(n, p.kind, p.group_size, t.kind, p.out_features, p.in_features, t.nbytes() / 1e6, "MB")
buf = torch.empty(300_000_000, dtype=torch.uint8)
for rows in (1, 2, 4, 8):
    x = torch.randn(rows, p.in_features); ts = []
    for _ in range(15):
        buf.add_(1)   # evict
        t0 = time.perf_counter(); qgemm.qgemm_q8(x, t); ts.append(time.perf_counter() - t0)
    med = statistics.median(ts)
    print(rows, f"{med*1e3:.2f} ms {t.nbytes()/med/1e9:.1f} GB/s")
ts = []
for _ in range(10):
    buf.add_(1)
    t0 = time.perf_counter(); s = t.qw.view(torch.int64).sum(); ts.append(time.perf_counter() - t0)
print("torch sum of the tiles", f"{statistics.median(ts)*1e3:.2f} ms {t.qw.numel()/statistics.median(ts)/1e9:.1f} GB/s")
