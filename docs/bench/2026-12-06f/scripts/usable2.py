"""python usable2.py MODEL PRECISION: StackPlan.usable() timed where a decode step calls it (after the
weights streamed through the caches) and called again at once (cache-warm)."""
import sys, time, random
from tokenmill.bench.peers.tokenmill_engine import TokenmillEngine
from tokenmill.runner import fused_plan
e = TokenmillEngine(dict(precision=sys.argv[2], model_path=sys.argv[1], max_seq_len=1024, num_threads=2,
                         max_num_seqs=32, prefill_len=512, kv_cache_dtype="fp16"))
orig = fused_plan.StackPlan.usable
acc = [0.0, 0.0, 0]
def w(self):
    t = time.perf_counter(); r = orig(self); t1 = time.perf_counter(); orig(self); t2 = time.perf_counter()
    acc[0] += t1 - t; acc[1] += t2 - t1; acc[2] += 1; return r
fused_plan.StackPlan.usable = w
rng = random.Random(0); p = [rng.randrange(100, 30000) for _ in range(128)]
for _ in range(3):
    acc[:] = [0.0, 0.0, 0]; e.single(p, 257)
    print(f"first {acc[0]/acc[2]*1e6:.1f} us, again {acc[1]/acc[2]*1e6:.1f} us, pins {len(e.engine.model_executor if False else [])}")
