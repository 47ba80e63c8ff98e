# 32 random 128-token prompts, 128 new tokens each, one generate (bench compare's throughput workload); and the prompts alone (max_tokens=1)
import sys, time, torch
from tokenmill import LLM, SamplingParams
dt = sys.argv[1]
llm = LLM(model="smollm2-135m", cpu_gemm_dtype=dt, max_num_seqs=32, enable_prefix_caching=False, num_threads=2, kv_cache_dtype=(sys.argv[2] if len(sys.argv) > 2 else "auto"))
g = torch.Generator().manual_seed(0)
prompts = [{"prompt_token_ids": torch.randint(100, 40000, (128,), generator=g).tolist()} for _ in range(32)]
llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
for r in range(2):
    t = time.perf_counter(); llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False); p = time.perf_counter() - t
    t = time.perf_counter(); llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False); s = time.perf_counter() - t
    print(f"{dt}: prompts alone {p:.2f} s; 32x128 {s:.2f} s = {32*128/s:.1f} out tok/s", flush=True)
