"""python count_ops.py MODEL PRECISION: aten ops per batch-1 decode step (a TorchDispatchMode), and
where in tokenmill they come from."""
import sys, random, collections, traceback

from torch.utils._python_dispatch import TorchDispatchMode
from tokenmill.bench.peers.tokenmill_engine import TokenmillEngine
e = TokenmillEngine(dict(precision=sys.argv[2], model_path=sys.argv[1], max_seq_len=1024, num_threads=2,
                         max_num_seqs=32, prefill_len=512, kv_cache_dtype="fp16"))
rng = random.Random(0); p = [rng.randrange(100, 30000) for _ in range(128)]
e.single(p, 8)
c = collections.Counter(); where = collections.Counter()
class M(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        c[str(func)] += 1
        st = traceback.extract_stack(limit=6)
        fr = [f for f in st if "tokenmill" in f.filename]
        if fr: where[f"{fr[-1].filename.split('tokenmill/')[-1]}:{fr[-1].lineno} {fr[-1].name}"] += 1
        return func(*args, **(kwargs or {}))
e.single(p, 2)
with M():
    e.single(p, 2)
with M():
    pass
c2 = collections.Counter(c); w2 = collections.Counter(where); c.clear(); where.clear()
with M():
    e.single(p, 12)
n = 10
print("ops per decode step:", sum((c - c2).values()) / n)
for k, v in ((c - c2)).most_common(25): print(f"{v/n:5.1f} {k}")
print("---")
for k, v in ((where - w2)).most_common(40): print(f"{v/n:5.1f} {k}")
