# usage: prefill.py float32|bfloat16 NPROMPTS LEN REPS: times a prefill-only generate (max_tokens=1)
import sys, time, torch
from tokenmill import LLM, SamplingParams
dt, n, L, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = LLM(model="smollm2-135m", cpu_gemm_dtype=dt, max_num_seqs=max(n, 8), enable_prefix_caching=False,
          max_num_batched_tokens=max(2048, L + 1))
g = torch.Generator().manual_seed(0)
prompts = [{"prompt_token_ids": torch.randint(100, 40000, (L,), generator=g).tolist()} for _ in range(n)]
sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
llm.generate(prompts[:2], sp, use_tqdm=False)
for r in range(reps):
    t = time.perf_counter(); llm.generate(prompts, sp, use_tqdm=False)
    s = time.perf_counter() - t
    print(dt, n, L, "prefill s %.3f tok/s %.0f" % (s, n * L / s), flush=True)
