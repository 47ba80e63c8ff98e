"""python glue_split.py MODEL PRECISION: per-step us of the engine's phases at batch-1 decode (256 steps after a
128-token prompt, fp16 K/V; perf_counter wrappers; C kernel calls apart as C:tm_*). Wrappers nest: execute holds the rest."""
import sys, time, random, collections, functools
from tokenmill.bench.peers.tokenmill_engine import TokenmillEngine
from tokenmill.layers import native
from tokenmill.runner import model_runner, fused_stack
model, prec = sys.argv[1], sys.argv[2]
e = TokenmillEngine(dict(precision=prec, model_path=model, max_seq_len=1024, num_threads=2,
                         max_num_seqs=32, prefill_len=512, kv_cache_dtype="fp16"))
acc = collections.Counter()
def wrap(obj, name, label=None):
    f = getattr(obj, name); label = label or name
    @functools.wraps(f)
    def w(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: acc[label] += time.perf_counter() - t
    setattr(obj, name, w)
eng = e.llm.engine
lib = native.library()
class P:
    def __getattr__(self, name):
        f = getattr(lib, name)
        if not name.startswith("tm_"): return f
        def w(*a):
            t = time.perf_counter(); r = f(*a); acc["C:" + name] += time.perf_counter() - t; return r
        return w
proxy = P(); native.library = lambda: proxy
wrap(eng.scheduler, "schedule"); wrap(eng.scheduler, "update_from_output")
wrap(eng.output_processor, "process"); wrap(eng, "_record")
runner = eng.executor.worker.runner
wrap(runner, "execute", "runner.execute"); wrap(runner, "_update_states"); wrap(runner, "_forward"); wrap(runner, "_sample")
wrap(model_runner, "build_model_input"); wrap(model_runner, "_nonfinite_rows"); wrap(model_runner, "_flag_nonfinite")
wrap(runner.model, "compute_logits"); wrap(runner.model, "embed")
wrap(fused_stack, "run_layers"); wrap(fused_stack, "layer_cache_views")
wrap(runner.backend, "build_metadata") if hasattr(runner.backend, "build_metadata") else None
rng = random.Random(0)
p = [rng.randrange(100, 30000) for _ in range(128)]
e.single(p, 8)
for _ in range(3):
    acc.clear()
    toks, first, tot = e.single(p, 2)
    pre = dict(acc); acc.clear()
    toks, first, tot = e.single(p, 257)
    step = (tot - first) / 256
    d = {k: (v - pre.get(k, 0)) / 256 * 1e6 for k, v in acc.items()}
    print(f"step {step*1e6:.0f} us: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(d.items(), key=lambda kv: -kv[1])))
