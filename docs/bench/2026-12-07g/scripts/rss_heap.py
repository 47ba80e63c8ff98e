# peak RSS and throughput of 32 x 128 prompts (128 new tokens) under a keep_freed_heap setting; usage: rss_heap.py MODEL PRECISION TRIM_MB|off|default
import sys, time, torch, resource
import tokenmill.runner.model_loader as ml
from tokenmill.utils import heap
model, prec, trim = sys.argv[1], sys.argv[2], sys.argv[3]
if trim == "off": ml.keep_freed_heap = lambda: False
elif trim != "default": ml.keep_freed_heap = lambda: heap.keep_freed_heap(int(trim) << 20)
from tokenmill import LLM, SamplingParams
kw = dict(quantization="gguf", quant_activations="q8", kv_cache_dtype="fp16") if prec == "gguf-q8" else dict(cpu_gemm_dtype="bfloat16", kv_cache_dtype="bf16")
llm = LLM(model=model, max_num_seqs=32, enable_prefix_caching=False, num_threads=2, **kw)
g = torch.Generator().manual_seed(0)
prompts = [{"prompt_token_ids": torch.randint(100, 40000, (128,), generator=g).tolist()} for _ in range(32)]
t = time.perf_counter(); llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False); s = time.perf_counter() - t
print(f"{model} {prec} trim {trim}: {32*128/s:.1f} out tok/s, peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1024:.0f} MB", flush=True)
