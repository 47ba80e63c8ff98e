# usage: python profile_b1.py  (run from outside the repo with PYTHONPATH=<tree>; the drafter path is /work/drafters/eagle3-more)
"""Where a chat batch-1 ngram_eagle3_int8 step goes: verify, drafting, the engine outside the runner."""
import time
from types import SimpleNamespace
from tokenmill import LLM, SamplingParams
from tokenmill.spec import bench
from tokenmill.spec.decoder import build_spec_decoder
llm = LLM(model="smollm2-135m", num_threads=2, max_num_seqs=1)
eng = llm.engine
args = SimpleNamespace(drafter=["eagle3=/work/drafters/eagle3-more"], k=3, layer_skip_layers=2, draft_model=None)
cfg = bench._configs(["ngram_eagle3_int8"], args)["ngram_eagle3_int8"]
dec = build_spec_decoder(cfg, eng.runner, eng.max_model_len, eng.scheduler.kv.num_total_blocks)
prompts, _ = bench._prompts(eng.tokenizer, "chat", 8, "sharegpt")
params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
res = {}
for rnd in range(2):
    for name, d in (("none", None), ("spec", dec)):
        bench._use(eng, d)
        if d is not None: d.reset_stats()
        t = time.perf_counter(); llm.generate(prompts, params, use_tqdm=False); res[name] = time.perf_counter() - t
s = dec.stats
tokens = 8 * 96
print(f"plain: {1000 * res['none'] / tokens:.2f} ms/token (whole engine)")
print(f"spec: {1000 * res['spec'] / tokens:.2f} ms/token; verify steps {s.num_steps}, verify {1000 * s.verify_time / s.num_steps:.2f} ms/step, "
      f"drafting {1000 * s.draft_time / s.num_steps:.2f} ms/step, tokens/step {tokens / s.num_steps:.2f}, "
      f"outside runner {1000 * (res['spec'] - s.verify_time - s.draft_time) / s.num_steps:.2f} ms/step")
print("plain step (runner) ms", {b: round(1000 * v, 2) for b, v in dec.plain_cost.seconds.items()}, "speedup", round(res['none'] / res['spec'], 3))
