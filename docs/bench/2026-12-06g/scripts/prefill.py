"""python prefill.py MODEL PREC N: prefill of N random tokens to first token, batch 1, timed 5x;
with PROFILE=1, a torch profiler table of one prefill."""
import sys, time, random, os
import torch
from tokenmill.bench.peers.tokenmill_engine import TokenmillEngine
model, prec, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
e = TokenmillEngine(dict(precision=prec, model_path=model, max_seq_len=n + 64, num_threads=2,
                         max_num_seqs=32, prefill_len=n, kv_cache_dtype="fp16"))
rng = random.Random(0)
ps = [[rng.randrange(0, int(os.environ.get("VOCAB", 30000))) for _ in range(n)] for _ in range(6)]
e.single(ps[0], 1)
for p in ps[1:]:
    t = time.perf_counter(); e.single(p, 1); dt = time.perf_counter() - t
    print(f"prefill {n}: {dt*1e3:.1f} ms, {n/dt:.1f} tok/s")
if os.environ.get("PROFILE"):
    with torch.profiler.profile() as prof:
        e.single(ps[1], 1)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
