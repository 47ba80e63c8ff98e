"""Decode speed where attention is a large part of the step, for an old / new A/B run in
alternating processes (PYTHONPATH picks the tree): batch 1 at ~3000 tokens of context
(gguf-q8, fp16 KV) and 16 sequences at ~200 (fp32). Prints one line of tok/s.
usage: PYTHONPATH=TREE python ab_attention.py LABEL"""
import random, sys, time
from tokenmill import LLM, SamplingParams
rng = random.Random(0)
out = []
for kw, batch, ctx in ((dict(quantization="gguf", quant_activations="q8", kv_cache_dtype="fp16"), 1, 3000),
                       (dict(), 16, 200)):
    llm = LLM(model="smollm2-135m", num_threads=2, skip_tokenizer_init=True, max_model_len=4096,
              max_num_seqs=16, **kw)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(ctx)]} for _ in range(batch)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)   # prefix cache warm
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=65, ignore_eos=True), use_tqdm=False)
    out.append(batch * 64 / (time.perf_counter() - t - t1))
    del llm
print(sys.argv[1], f"b1 ctx3000 q8 {out[0]:.1f} tok/s  b16 ctx200 fp32 {out[1]:.1f} tok/s", flush=True)
