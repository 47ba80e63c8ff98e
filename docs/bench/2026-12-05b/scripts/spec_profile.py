# usage: spec_profile.py [DRAFTER_DIR] [--k K] [--prof]: where a batch-1 chat T=0 step of ngram_eagle3_int8
# spends its time (SmolLM2-135M fp32, 2 threads, bench spec's 8 ShareGPT prompts, 96 tokens),
# against plain decoding in the same process. Engine steps are timed from the outside; the
# decoder's own counters split drafting from verifying.
import argparse, cProfile, pstats, statistics, sys, time
from argparse import Namespace
from tokenmill import LLM, SamplingParams
from tokenmill.spec import bench as sb
from tokenmill.spec.decoder import build_spec_decoder

ap = argparse.ArgumentParser()
ap.add_argument("drafter", nargs="?", default="/work/drafters/eagle3-more")
ap.add_argument("--method", default="ngram_eagle3_int8")
ap.add_argument("--quantization", default=None)
ap.add_argument("--quant-activations", default="fp32")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--k", type=int, default=3)
ap.add_argument("--prof", action="store_true")
ap.add_argument("--sort", default="tottime")
ap.add_argument("--top", type=int, default=25)
a = ap.parse_args()
llm = LLM(model="smollm2-135m", num_threads=2, max_num_seqs=1, sliding_window_pools=False,
          quantization=a.quantization, quant_activations=a.quant_activations)
engine = llm.engine
cfg = sb._configs([a.method], Namespace(drafter=[f"eagle3={a.drafter}", f"dflash={a.drafter}"],
                                       k=a.k, layer_skip_layers=4, draft_model=None))[a.method]
dec = build_spec_decoder(cfg, engine.runner, engine.max_model_len, engine.scheduler.kv.num_total_blocks)
prompts, _ = sb._prompts(engine.tokenizer, "chat", 8, "sharegpt")
params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)

step_times = []
inner = engine.step
def timed_step():
    t = time.perf_counter(); out = inner(); step_times.append(time.perf_counter() - t); return out
engine.step = timed_step

def run(d, salt):
    sb._use(engine, d)
    ps = sb._salted(prompts, d, salt)
    step_times.clear()
    t = time.perf_counter()
    outs = [llm.generate([p], params, use_tqdm=False)[0] for p in ps]   # batch 1
    wall = time.perf_counter() - t
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    return wall, toks, list(step_times)

run(None, "none"); run(dec, "spec")            # warm-up: prefix caches, drafter context
rows = {"none": [], "spec": []}
for r in range(a.rounds):
    rows["none"].append(run(None, "none"))
    dec.reset_stats()
    if a.prof and r == a.rounds - 1:
        prof = cProfile.Profile(); prof.enable()
    rows["spec"].append(run(dec, "spec") + (dec.stats,))
    if a.prof and r == a.rounds - 1:
        prof.disable()
best = {k: min(v, key=lambda x: x[0]) for k, v in rows.items()}
wall_n, tok_n, steps_n = best["none"][:3]
wall_s, tok_s, steps_s, st = best["spec"]
plain_ms = 1000 * statistics.median(steps_n[1:])
print(f"plain: {tok_n / wall_n:.1f} tok/s, {len(steps_n)} engine steps, median step {plain_ms:.2f} ms")
print(f"spec:  {tok_s / wall_s:.1f} tok/s ({tok_s / wall_s / (tok_n / wall_n):.2f}x), {len(steps_s)} engine steps, "
      f"tau {st.mean_acceptance_length:.2f}, median step {1000 * statistics.median(steps_s[1:]):.2f} ms")
n = max(st.num_steps, 1)
verify_ms, draft_ms = 1000 * st.verify_time / n, 1000 * st.draft_time / len(steps_s)
step_ms = 1000 * sum(steps_s) / len(steps_s)
print(f"  per engine step: {step_ms:.2f} ms = runner (verify) {verify_ms:.2f} ms on {st.num_steps} drafted steps "
      f"+ drafting {draft_ms:.2f} ms + the rest")
print(f"  in plain steps: step {step_ms / plain_ms:.2f}x a plain one; tokens per step {tok_s / len(steps_s):.2f}; "
      f"verify {verify_ms / plain_ms:.2f}x, draft {draft_ms / plain_ms:.2f}x")
print(f"  wall outside engine steps: plain {wall_n - sum(steps_n):.3f} s, spec {wall_s - sum(steps_s):.3f} s")
if a.prof:
    pstats.Stats(prof, stream=sys.stdout).sort_stats(a.sort).print_stats(a.top)
