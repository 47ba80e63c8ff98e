# one long prompt, then many decode steps (SmolLM2); prints decode tok/s per 100 steps; usage: longdec.py CTX NEW fp32|bf16|gguf-q8 KV_CACHE_DTYPE [ISA]
import sys, time, torch, glob, os
from tokenmill import LLM, SamplingParams
ctx, new, prec, kv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
isa = sys.argv[5] if len(sys.argv) > 5 else "native"   # [ISA]: added in 2026-12-07h
gg = glob.glob(os.path.expanduser("~/.cache/tokenmill/smollm2-135m/*.gguf"))
kw = dict(quantization="gguf", quant_activations="q8") if prec == "gguf-q8" else dict(cpu_gemm_dtype="bfloat16" if prec == "bf16" else "float32")
llm = LLM(model=gg[0] if prec == "gguf-q8" else "smollm2-135m", num_threads=2, cpu_isa=isa, kv_cache_dtype=kv, max_model_len=ctx + new + 8, enable_prefix_caching=False, skip_tokenizer_init=True, block_size=16, num_kv_blocks=(ctx + new + 8) // 16 + 2, **kw)
prompt = torch.randint(100, 40000, (ctx,), generator=torch.Generator().manual_seed(0)).tolist()
e = llm.engine
e.add_request(None, {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
e.step()
print("prefill done", flush=True)
times = []
while e.has_unfinished_requests():
    t = time.perf_counter(); e.step(); times.append(time.perf_counter() - t)
for a in range(0, len(times), 100):
    seg = times[a:a + 100]
    print(f"steps {a}-{a+len(seg)}: {len(seg)/sum(seg):.1f} tok/s", flush=True)
