# batch-1 decode tok/s after a short prompt; usage: b1.py fp32|gguf-q8 ISA
import sys, time, torch, glob, os
from tokenmill import LLM, SamplingParams
prec, isa = sys.argv[1], sys.argv[2]
gg = glob.glob(os.path.expanduser("~/.cache/tokenmill/smollm2-135m/*.gguf"))
kw = dict(quantization="gguf", quant_activations="q8") if prec == "gguf-q8" else dict(cpu_gemm_dtype="float32")
llm = LLM(model=gg[0] if prec == "gguf-q8" else "smollm2-135m", num_threads=2, cpu_isa=isa, max_model_len=1024, enable_prefix_caching=False, skip_tokenizer_init=True, kv_cache_dtype="fp16" if prec == "gguf-q8" else "auto", **kw)
prompt = torch.randint(100, 40000, (128,), generator=torch.Generator().manual_seed(0)).tolist()
for r in range(3):
    e = llm.engine
    e.add_request(None, {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
    e.step(); times = []
    while e.has_unfinished_requests():
        t = time.perf_counter(); e.step(); times.append(time.perf_counter() - t)
    print(prec, isa, f"decode {len(times)/sum(times):.1f} tok/s", flush=True)
