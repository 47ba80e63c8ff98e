"""Step-interleaved decode A/B: python ab_steps.py MODEL PREC name=rel:path[,rel:path]... ; the library switches
every BLOCK decode steps under one engine and request (the first step of a block is not counted)."""
import sys, os, time, random, statistics
sys.path.insert(0, "docs/bench/2026-12-06f/scripts")
from builds import library
from tokenmill.layers import native
model, prec = sys.argv[1], sys.argv[2]
libs = {"base": native.library()}
for spec in sys.argv[3:]:
    name, files = spec.split("=", 1)
    libs[name] = library({rel: open(path).read() for rel, path in (f.split(":") for f in files.split(","))})
names = list(libs); current = ["base"]
class P:
    def __getattr__(self, name): return getattr(libs[current[0]], name)
proxy = P(); native.library = lambda: proxy
from tokenmill.bench.peers.tokenmill_engine import TokenmillEngine
ctx = int(os.environ.get("CTX", 128)); steps = int(os.environ.get("STEPS", 1024)); block = int(os.environ.get("BLOCK", 4))
e = TokenmillEngine(dict(precision=prec, model_path=model, max_seq_len=ctx + steps + 64, num_threads=int(os.environ.get("NT", 2)),
                         max_num_seqs=32, prefill_len=512, kv_cache_dtype=os.environ.get("KV", "fp16")))
rng = random.Random(0); p = [rng.randrange(100, 30000) for _ in range(ctx)]
e.single(p, 4)
eng = e.llm.engine; orig = eng.step; count = [0]; times = {k: [] for k in names}
def step(*a, **k):
    i = count[0]; count[0] += 1
    lib = names[(i // block) % len(names)]; current[0] = lib
    t = time.perf_counter(); r = orig(*a, **k); dt = time.perf_counter() - t
    if i % block and i > 2: times[lib].append(dt)
    return r
eng.step = step
e.single(p, steps)
for k in names:
    t = sorted(times[k]); n = len(t)
    print(f"{k}: {n} steps, median {statistics.median(t)*1e3:.3f} ms, mean of middle half {statistics.mean(t[n//4:3*n//4])*1e3:.3f} ms")
for k in names[1:]:
    print(f"{k} speed vs base: median {statistics.median(times['base'])/statistics.median(times[k]):.3f}")
