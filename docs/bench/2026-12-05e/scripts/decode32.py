# 32 x 128-token prompts prefix-cached, then 128 decode steps at 32 sequences (prefill nearly free); prints READY before the measured part. usage: decode32.py CPU_GEMM_DTYPE [ROUNDS [KV_CACHE_DTYPE]]
import sys, time, torch, os
from tokenmill import LLM, SamplingParams
dt = sys.argv[1]
llm = LLM(model="smollm2-135m", cpu_gemm_dtype=dt, max_num_seqs=32, enable_prefix_caching=True, kv_cache_dtype=(sys.argv[3] if len(sys.argv) > 3 else "auto"))
g = torch.Generator().manual_seed(0)
prompts = [{"prompt_token_ids": torch.randint(100, 40000, (128,), generator=g).tolist()} for _ in range(32)]
llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
print("READY", os.getpid(), flush=True); time.sleep(1.0)
for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 1):
    t = time.perf_counter(); llm.generate(prompts, SamplingParams(temperature=0, max_tokens=129, ignore_eos=True), use_tqdm=False)
    s = time.perf_counter() - t; print("decode ms/step %.1f" % (s / 128 * 1e3), flush=True)
