# usage: python q8_verify_bits.py q8|fp32 DRAFTER_DIR  (run from outside the repo, PYTHONPATH=<tree>)
"""Target hidden rows of a verify step vs the plain decode step at the same (request, position):
bit-identical? fp32 or q8 target, EAGLE-3 (float, random-free: the trained one) drafting."""
import sys, torch
from types import SimpleNamespace
from tokenmill import LLM, SamplingParams
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.spec import bench
from tokenmill.spec.decoder import build_spec_decoder
q8 = sys.argv[1] == "q8"
llm = LLM(model="smollm2-135m", num_threads=2, max_num_seqs=1, enable_prefix_caching=False,
          **(dict(quantization="gguf", quant_activations="q8") if q8 else {}))
eng = llm.engine
rec = {}
cur = {"name": None}
real = ModelRunner._forward
def fwd(self, inp, aux):
    h = real(self, inp, aux)
    ql = inp.attn_meta.query_start_loc.tolist()
    for i, r in enumerate(inp.req_ids):
        for row in range(ql[i], ql[i + 1]):
            key = (tuple(inp.input_ids[ql[i]:row + 1].tolist())[-8:], int(inp.positions[row]))
            rec.setdefault(cur["name"], {})[key] = (h[row].clone(), ql[i + 1] - ql[i])
    return h
ModelRunner._forward = fwd
from tokenmill.runner import fused_stack
from collections import Counter
used = Counter()
realf = fused_stack.forward
def ff(model, ids, *a, **k):
    out = realf(model, ids, *a, **k)
    used[(ids.shape[0], out is not None)] += 1
    return out
fused_stack.forward = ff
args = SimpleNamespace(drafter=["eagle3=" + sys.argv[2] + ""], k=3, layer_skip_layers=2, draft_model=None)
cfg = bench._configs(["eagle3"], args)["eagle3"]
prompts, _ = bench._prompts(eng.tokenizer, "chat", 4, "sharegpt")
params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
for name in ("none", "eagle3"):
    dec = None if name == "none" else build_spec_decoder(cfg, eng.runner, eng.max_model_len, eng.scheduler.kv.num_total_blocks)
    bench._use(eng, dec); cur["name"] = name
    outs = llm.generate(prompts, params, use_tqdm=False)
    rec[name + "_out"] = [o.outputs[0].token_ids for o in outs]
bench._use(eng, None)
a, b = rec["none"], rec["eagle3"]
same = diff = 0; worst = 0.0; by_m = {}
for key, (h, m) in b.items():
    if key in a and m > 1 and a[key][1] == 1:
        eq = torch.equal(h, a[key][0]); same += eq; diff += not eq
        by_m.setdefault(m, [0, 0])[eq] += 1
        worst = max(worst, (h - a[key][0]).abs().max().item())
print("q8" if q8 else "fp32", "verify rows vs decode rows: identical", same, "differ", diff, "max abs diff", worst, "by M [differ, same]", by_m)
print(sorted(used.items()))
print("outputs identical:", rec["none_out"] == rec["eagle3_out"])
