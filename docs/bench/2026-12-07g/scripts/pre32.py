# the prompts of thr32.py alone (32 x 128 tokens, max_tokens=1), repeated; usage: pre32.py DTYPE KV [profile]
import sys, time, torch, cProfile, pstats
from tokenmill import LLM, SamplingParams
dt = sys.argv[1]
llm = LLM(model="smollm2-135m", cpu_gemm_dtype=dt, max_num_seqs=32, enable_prefix_caching=False, num_threads=2, kv_cache_dtype=sys.argv[2])
g = torch.Generator().manual_seed(0)
prompts = [{"prompt_token_ids": torch.randint(100, 40000, (128,), generator=g).tolist()} for _ in range(32)]
sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
llm.generate(prompts[:4], sp, use_tqdm=False)
for r in range(3):
    t = time.perf_counter(); llm.generate(prompts, sp, use_tqdm=False); print(f"{dt}: prompts {time.perf_counter() - t:.3f} s", flush=True)
if len(sys.argv) > 3:
    pr = cProfile.Profile(); pr.enable(); llm.generate(prompts, sp, use_tqdm=False); pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(14)
