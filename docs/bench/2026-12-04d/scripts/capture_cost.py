# usage: python capture_cost.py q8|fp32 DRAFTER_DIR  (run from outside the repo, PYTHONPATH=<tree>)
"""Median time of the C stack per decode step with and without the drafter's layer capture
(same step, same inputs; the KV writes are the same values twice)."""
import statistics, sys, time
from types import SimpleNamespace
from tokenmill import LLM, SamplingParams
from tokenmill.runner import fused_stack
from tokenmill.spec import bench
from tokenmill.spec.decoder import build_spec_decoder
quant = sys.argv[1] == "q8"
llm = LLM(model="smollm2-135m", num_threads=2, max_num_seqs=8, **(dict(quantization="gguf", quant_activations="q8") if quant else {}))
eng = llm.engine
times = {"plain": [], "aux": []}
real = fused_stack.run_layers
from collections import Counter
seen = Counter()
def timed(model, x, positions, kv, meta, backend, aux=None):
    seen[(aux is None, x.shape[0])] += 1
    if aux is None:
        return real(model, x, positions, kv, meta, backend, aux)
    for i in range(2):
        t = time.perf_counter(); real(model, x, positions, kv, meta, backend, None); times["plain"].append(time.perf_counter() - t)
        t = time.perf_counter(); out = real(model, x, positions, kv, meta, backend, aux); times["aux"].append(time.perf_counter() - t)
    return out
fused_stack.run_layers = timed
args = SimpleNamespace(drafter=["eagle3=" + sys.argv[2] + ""], k=3, layer_skip_layers=2, draft_model=None)
cfg = bench._configs(["adaptive_eagle3_int8"], args)["adaptive_eagle3_int8"]
prompts, _ = bench._prompts(eng.tokenizer, "chat", 4, "sharegpt")
dec = build_spec_decoder(cfg, eng.runner, eng.max_model_len, eng.scheduler.kv.num_total_blocks)
bench._use(eng, dec)
for p in prompts:
    llm.generate([p], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
for k, v in times.items():
    print(k, len(v), "median ms %.3f" % (1e3 * statistics.median(v)))
print("aux - plain ms %.3f" % (1e3 * (statistics.median(times["aux"]) - statistics.median(times["plain"]))))
print(seen)
