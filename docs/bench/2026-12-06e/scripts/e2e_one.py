"""One process of e2e_ab.sh: python e2e_one.py MODEL PRECISION -> one JSON line: prefill tok/s
(best of 3 prompts of 512 tokens), batch-1 decode tok/s (best of 2 runs of 128 tokens after a
128-token prompt), throughput (32 prompts x 64 tokens in one generate call) and the first
tokens (every tree must give the same). 2 threads, fp16 K/V, as bench compare's rows."""
import json, random, sys, time
import tokenmill
from tokenmill.bench.peers.tokenmill_engine import TokenmillEngine
model, prec = sys.argv[1], sys.argv[2]
e = TokenmillEngine(dict(precision=prec, model_path=model, max_seq_len=1024, num_threads=2,
                         max_num_seqs=32, prefill_len=512, kv_cache_dtype="fp16"))
rng = random.Random(0)
p512 = [rng.randrange(100, 30000) for _ in range(512)]
p128 = [rng.randrange(100, 30000) for _ in range(128)]
e.single(p512, 1); e.single(p128, 8)
pre = []
for _ in range(3):
    t0 = time.perf_counter(); e.single(p512, 1); pre.append(512 / (time.perf_counter() - t0))
dec = []
for _ in range(2):
    toks, first, tot = e.single(p128, 129)
    dec.append(128 / (tot - first))
batch = [[rng.randrange(100, 30000) for _ in range(128)] for _ in range(32)]
t0 = time.perf_counter(); outs = e.batch(batch, 64); thr = 32 * 64 / (time.perf_counter() - t0)
print(json.dumps(dict(src=tokenmill.__file__, prefill=max(pre), decode=max(dec), thr=thr, tok=outs[0][:8])))
