"""python wrap.py MODEL PRECISION module:Qualified.name,...: the decode step of split.py, with each named
function wrapped by a timer: microseconds per step (prefill calls taken off)."""
import sys, time, random, collections, importlib
from tokenmill.bench.peers.tokenmill_engine import TokenmillEngine
model, prec = sys.argv[1], sys.argv[2]
targets = sys.argv[3].split(",")
e = TokenmillEngine(dict(precision=prec, model_path=model, max_seq_len=1024, num_threads=2,
                         max_num_seqs=32, prefill_len=512, kv_cache_dtype="fp16"))
acc = collections.defaultdict(float); cnt = collections.Counter()
def wrap(owner, name, label):
    f = getattr(owner, name)
    def w(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[label] += time.perf_counter() - t; cnt[label] += 1; return r
    setattr(owner, name, w)
for tgt in targets:
    mod, attr = tgt.rsplit(":", 1)
    m = importlib.import_module(mod)
    owner = m
    parts = attr.split(".")
    for p in parts[:-1]: owner = getattr(owner, p)
    wrap(owner, parts[-1], attr)
rng = random.Random(0)
p128 = [rng.randrange(100, 30000) for _ in range(128)]
e.single(p128, 8)
for _ in range(3):
    e.single(p128, 2)
    base = dict(acc); bc = dict(cnt)
    toks, first, tot = e.single(p128, 2)
    pre = {k: acc[k] - base.get(k, 0) for k in acc}; prec_ = {k: cnt[k] - bc.get(k, 0) for k in cnt}
    base = dict(acc); bc = dict(cnt)
    toks, first, tot = e.single(p128, 257)
    step = (tot - first) / 256
    print(f"step {step*1e3:.3f} ms | " + " ".join(
        f"{k}:{(acc[k]-base.get(k,0)-pre.get(k,0))/256*1e6:.1f}us" for k in acc))
