"""b8 adaptive diagnosis: none vs ngram-k3 vs adaptive vs forced k=0 (k0_<method>) vs the
controller before 2026-12-05f (old_<method>), per-step times."""
import sys, time, statistics
from tokenmill import LLM, SamplingParams
from tokenmill.spec.decoder import build_spec_decoder
from tokenmill.spec.adaptive import FixedK
from tokenmill.spec import bench as B

workload = sys.argv[1] if len(sys.argv) > 1 else "grounded"
methods = sys.argv[2].split(",") if len(sys.argv) > 2 else ["ngram", "adaptive_ngram", "k0_ngram"]
drafter = sys.argv[3] if len(sys.argv) > 3 else None
reps = 3
import os
q8 = os.environ.get("Q8") == "1"
llm = LLM(model="smollm2-135m", num_threads=2, max_num_seqs=8, kv_cache_memory=1024 * 1024**2,
          sliding_window_pools=False, quantization="gguf" if q8 else None, quant_activations="q8" if q8 else "fp32")
eng = llm.engine
prompts, _ = B._prompts(eng.tokenizer, workload, 8, "sharegpt")
params = [SamplingParams(temperature=0, max_tokens=96, ignore_eos=True) for _ in range(8)]
class A: k = 3; layer_skip_layers = 8; draft_model = None
A.drafter = [f"eagle3={drafter}"] if drafter else []
decs = {"none": None}
for m in methods:
    force0 = m.startswith("k0_")
    old = m.startswith("old_")
    cfgs = B._configs([m.removeprefix("k0_").removeprefix("old_")], A)
    d = build_spec_decoder(list(cfgs.values())[0], eng.runner, eng.max_model_len, eng.scheduler.kv.num_total_blocks)
    if force0:
        d.controller = FixedK(0)
    if old:
        import subprocess, types   # the controller before 2026-12-05f, read from git
        src = subprocess.run(["git", "show", "c1c3739:tokenmill/spec/adaptive.py"], check=True,
                             capture_output=True, text=True).stdout
        old_module = sys.modules["adaptive_old"] = types.ModuleType("adaptive_old")
        exec(compile(src, "adaptive_old.py", "exec"), old_module.__dict__)
        OldK = old_module.AdaptiveK
        d.controller = OldK(d.controller.k_max, d.controller.modes)
    decs[m] = d
steps = []
orig = eng.step
def step():
    t = time.perf_counter(); r = orig(); steps.append(time.perf_counter() - t); return r
eng.step = step
rates = {m: [] for m in decs}
log = {m: [] for m in decs}
for rep in range(reps + 1):
    for m, d in decs.items():
        B._use(eng, d)
        steps.clear()
        r, toks = B._generate(llm, B._salted(prompts, d, m), params)
        if rep:
            rates[m].append(r)
            log[m].append(list(steps))
        if rep == 0 and d is not None:
            d.reset_stats()
for m in decs:
    st = [s for run in log[m] for s in run]
    print(f"{m:22s} tok/s {statistics.median(rates[m]):7.1f} ratio {statistics.median([a/b for a,b in zip(rates[m], rates['none'])]):.3f} "
          f"steps/run {len(st)/reps:.0f} median step {1000*statistics.median(st):.1f} ms  sum {1000*sum(st)/reps:.0f} ms "
          + (f"k {decs[m].stats.k_chosen} draft_s/run {decs[m].stats.draft_time/reps:.3f} est {decs[m].stats.estimated_speedup or 0:.3f}" if decs[m] else ""))
