# Gemma3-270m in bf16 mode: greedy tokens + logprobs with the float32 weights freed vs kept, and peak RSS
import sys, resource, torch
from tokenmill import LLM, SamplingParams
from tokenmill.layers import prepacked
if sys.argv[1] == "kept":
    prepacked._free_float_weight = lambda module, holders: 0
llm = LLM(model="gemma3-270m", cpu_gemm_dtype="bfloat16", max_num_seqs=8)
g = torch.Generator().manual_seed(0)
prompts = [{"prompt_token_ids": torch.randint(100, 40000, (200 + 50 * i,), generator=g).tolist()} for i in range(4)]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1), use_tqdm=False)
import hashlib
h = hashlib.sha1(str([(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in outs]).encode()).hexdigest()[:12]
m = llm.engine.get_memory_stats()
print(sys.argv[1], "outputs", h, "model_weights MB %.1f prepacked MB %.1f peak RSS MB %.0f" % (m["model_weights"] / 1e6, m["prepacked_weights"] / 1e6, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
