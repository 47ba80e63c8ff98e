# bf16 mode: peak RSS after load and after a 32 x 128 run, and a hash of greedy outputs (PYTHONPATH picks the tree)
import sys, time, torch, resource, hashlib, tokenmill
from tokenmill import LLM, SamplingParams
dt = sys.argv[1]
llm = LLM(model="smollm2-135m", cpu_gemm_dtype=dt, max_num_seqs=32, enable_prefix_caching=False)
rss_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
cur = int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
g = torch.Generator().manual_seed(0)
prompts = [{"prompt_token_ids": torch.randint(100, 40000, (128,), generator=g).tolist()} for _ in range(32)]
t = time.perf_counter()
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=1), use_tqdm=False)
s = time.perf_counter() - t
h = hashlib.sha1(str([(o.outputs[0].token_ids, [round(lp[t].logprob, 6) for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in outs]).encode()).hexdigest()[:12]
print(tokenmill.__file__.split("/tokenmill/")[0], dt, "peak RSS after load %.0f MB (current %.0f), after run %.0f MB; %.2f s; outputs %s; weight_bytes %.1f MB" % (
    rss_load, cur, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, s, h, llm.engine.weight_bytes / 1e6))
print(llm.engine.get_memory_stats()["model_weights"] / 1e6, llm.engine.get_memory_stats()["prepacked_weights"] / 1e6)
