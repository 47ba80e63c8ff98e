# prefill: 8 prompts of 512 random tokens (PREFILL_MODEL, default smollm2-135m), one at a time, max_tokens 1; usage: prefill_ab.py DTYPE ISA [KV [fp32-attention]] (the last: bf16 mode with the float32 prefill attention kernel)
import os, sys, time, torch
from tokenmill import LLM, SamplingParams
dt, isa = sys.argv[1], sys.argv[2]
if len(sys.argv) > 4 and sys.argv[4] == "fp32-attention":
    from tokenmill.layers import native; native.bf16_kernel = lambda: "avx512"   # prefill attention on the float32 kernel
llm = LLM(model=os.environ.get("PREFILL_MODEL", "smollm2-135m"), cpu_gemm_dtype=dt, cpu_isa=isa, num_threads=2, enable_prefix_caching=False,
          kv_cache_dtype=sys.argv[3] if len(sys.argv) > 3 else "auto")
g = torch.Generator().manual_seed(0)
prompts = [{"prompt_token_ids": torch.randint(100, 40000, (512,), generator=g).tolist()} for _ in range(8)]
sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
llm.generate(prompts[:1], sp, use_tqdm=False)
for r in range(3):
    t = time.perf_counter()
    for p in prompts: llm.generate([p], sp, use_tqdm=False)
    s = time.perf_counter() - t; print(dt, isa, "prefill tok/s %.0f" % (8 * 512 / s), flush=True)
