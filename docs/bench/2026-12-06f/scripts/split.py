"""python split.py MODEL PRECISION: batch-1 decode steps of 256 tokens after a 128-token prompt, 2 threads,
fp16 K/V (as bench compare's rows); every tm_* kernel call timed through a proxy of the library, so a
step splits into C (the kernels) and glue (everything else). Run under each tree with PYTHONPATH."""
import sys, time, random, collections
from tokenmill.bench.peers.tokenmill_engine import TokenmillEngine
from tokenmill.layers import native
model, prec = sys.argv[1], sys.argv[2]
e = TokenmillEngine(dict(precision=prec, model_path=model, max_seq_len=1024, num_threads=2,
                         max_num_seqs=32, prefill_len=512, kv_cache_dtype="fp16"))
lib = native.library()
acc = collections.defaultdict(float); cnt = collections.Counter()
class P:
    def __getattr__(self, name):
        f = getattr(lib, name)
        if not name.startswith("tm_"): return f
        def w(*a):
            t = time.perf_counter(); r = f(*a); acc[name] += time.perf_counter() - t; cnt[name] += 1; return r
        return w
proxy = P()
native.library = lambda: proxy
rng = random.Random(0)
p128 = [rng.randrange(100, 30000) for _ in range(128)]
e.single(p128, 8)
for _ in range(4):
    acc.clear(); cnt.clear()
    toks, first, tot = e.single(p128, 257)
    acc.clear(); cnt.clear()
    toks, first, tot = e.single(p128, 2)
    pre = dict(acc); cntp = dict(cnt)
    acc.clear(); cnt.clear()
    toks, first, tot = e.single(p128, 257)
    step = (tot - first) / 256
    c = {k: v - pre.get(k, 0) for k, v in acc.items()}
    ctot = sum(c.values()) / 256
    print(f"step {step*1e3:.3f} ms, C {ctot*1e3:.3f} ms, glue {1e3*(step-ctot):.3f} ms | " +
          " ".join(f"{k}:{v/256*1e3:.3f}ms/{(cnt[k]-cntp.get(k,0))/256:.1f}" for k, v in sorted(c.items(), key=lambda kv: -kv[1])[:6]))
