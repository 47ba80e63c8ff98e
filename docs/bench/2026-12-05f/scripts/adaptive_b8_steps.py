"""Per-step log of one adaptive decoder at b8: engine.step wall time vs what the controller records."""
import os, sys, time, statistics, collections
from tokenmill import LLM, SamplingParams
from tokenmill.spec.decoder import build_spec_decoder
from tokenmill.spec import bench as B
workload, method, drafter = sys.argv[1], sys.argv[2], sys.argv[3]
q8 = os.environ.get("Q8") == "1"
llm = LLM(model="smollm2-135m", num_threads=2, max_num_seqs=8, kv_cache_memory=1024 * 1024**2,
          sliding_window_pools=False, quantization="gguf" if q8 else None, quant_activations="q8" if q8 else "fp32")
eng = llm.engine
prompts, _ = B._prompts(eng.tokenizer, workload, 8, "sharegpt")
params = [SamplingParams(temperature=0, max_tokens=96, ignore_eos=True) for _ in range(8)]
class A: k = 3; layer_skip_layers = 8; draft_model = None; drafter = [f"eagle3={drafter}"]
cfg = list(B._configs([method], A).values())[0]
d = build_spec_decoder(cfg, eng.runner, eng.max_model_len, eng.scheduler.kv.num_total_blocks)
walls, recs = [], []
orig = eng.step
def step():
    t = time.perf_counter(); r = orig(); walls.append((time.perf_counter() - t, eng.runner.spec._pending[1] if eng.runner.spec and eng.runner.spec._pending else None)); return r
eng.step = step
rec = d.controller.record
def record(batch, k, seconds, verdicts=(), mode=0):
    recs.append((batch, k, mode, seconds, sum(a + 1 for _, a in verdicts)))
    return rec(batch, k, seconds, verdicts, mode)
d.controller.record = record
for rep in range(3):
    for dec in (None, d):
        B._use(eng, dec)
        walls.clear(); recs.clear()
        t = time.perf_counter()
        B._generate(llm, B._salted(prompts, dec, method), params)
        total = time.perf_counter() - t
        if dec:
            print(" k0 records (batch, seconds):", [(b, round(s * 1000, 1)) for b, k, m, s, _ in recs if k == 0])
            print(" none-run walls would be comparable; c(8) now", d.plain_cost.seconds.get(8))
        print("run", rep, "spec" if dec else "none", "total %.3f s" % total, "steps", len(walls), "sum steps %.3f" % sum(w for w, _ in walls))
        if dec and rep == 2:
            by = collections.defaultdict(list)
            for b, k, m, s, toks in recs:
                by[(b, k, m)].append((s, toks))
            for key, v in sorted(by.items()):
                print(" recorded", key, "n", len(v), "mean s %.4f" % statistics.mean(x for x, _ in v), "tokens/step %.2f" % statistics.mean(t for _, t in v))
            print(" recorded total %.3f s over %d steps" % (sum(s for *_, s, _ in recs), len(recs)))
            print(" arms", {k: (round(a.seconds / a.rows * 1000, 2) if a.rows else None, round(a.rate, 1)) for k, a in d.controller.arms.items() if k[0] == 8})
            print(" c(B)", getattr(d.plain_cost, "__dict__", None))
