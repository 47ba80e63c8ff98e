"""per-step us of run_layers' pieces (SmolLM2 gguf-q8, b1 decode, 256 steps)"""
import sys, time, random, collections, functools
from tokenmill.bench.peers.tokenmill_engine import TokenmillEngine
from tokenmill.models.hub import resolve_model
from tokenmill.layers import native
from tokenmill.runner import fused_stack, fused_plan
from tokenmill.layers.attention import metadata
acc = collections.Counter()
def wrap(obj, name, label=None):
    f = getattr(obj, name); label = label or name
    @functools.wraps(f)
    def w(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: acc[label] += time.perf_counter() - t
    setattr(obj, name, w)
e = TokenmillEngine(dict(precision="gguf-q8", model_path=resolve_model(sys.argv[1]), max_seq_len=1024, num_threads=2,
                         max_num_seqs=32, prefill_len=512, kv_cache_dtype="fp16"))
lib = native.library()
class P:
    def __getattr__(self, name):
        f = getattr(lib, name)
        if not name.startswith("tm_"): return f
        def w(*a):
            t = time.perf_counter(); r = f(*a); acc["C:" + name] += time.perf_counter() - t; return r
        return w
proxy = P(); native.library = lambda: proxy
for n in ("may_apply", "layer_cache_views", "run_layers", "forward"): wrap(fused_stack, n)
fused_stack.stack_plan = fused_plan.stack_plan
wrap(fused_stack, "stack_plan")
for n in ("usable", "activations", "max_rows", "cache_ptrs", "positions_ok"): wrap(fused_plan.StackPlan, n)
wrap(metadata.AttentionMetadata, "checked_query_positions")
rng = random.Random(0)
p = [rng.randrange(100, 30000) for _ in range(128)]
e.single(p, 8)
for _ in range(3):
    acc.clear(); e.single(p, 2); pre = dict(acc); acc.clear()
    toks, first, tot = e.single(p, 257)
    d = {k: (v - pre.get(k, 0)) / 256 * 1e6 for k, v in acc.items()}
    print(f"step {(tot-first)/256*1e6:.0f} us: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(d.items(), key=lambda kv: -kv[1])))
