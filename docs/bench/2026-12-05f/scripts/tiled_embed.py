"""bf16 mode's tied embedding read from the head's tiles ("tiles") against the float32 table
kept ("table", the loader's share patched out): perplexity and KL against float32 on
ShareGPT's evaluation split, greedy agreement with float32 on 4 random-token prompts, the
weights' accounting and the peak RSS of loading and generating. One variant per process.
Usage: tiled_embed.py MODEL tiles|table|fp32 [PPL_TOKENS]"""
import hashlib, json, resource, sys
import torch
from tokenmill import LLM, SamplingParams
from tokenmill.runner import model_loader

model, variant = sys.argv[1], sys.argv[2]
ppl_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
if variant == "table":
    model_loader.share_tiled_head_with_embedding = lambda m: False
gemm = "float32" if variant == "fp32" else "bfloat16"
llm = LLM(model=model, cpu_gemm_dtype=gemm, max_num_seqs=8)
rss_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
g = torch.Generator().manual_seed(0)
prompts = [{"prompt_token_ids": torch.randint(100, 40000, (200 + 50 * i,), generator=g).tolist()} for i in range(4)]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
tokens = [list(o.outputs[0].token_ids) for o in outs]
m = llm.engine.get_memory_stats()
rss_now = [int(l.split()[1]) // 1024 for l in open("/proc/self/status") if l.startswith("VmRSS")][0]
out = {"model": model, "variant": variant, "embedding": type(llm.engine.model.model.embed_tokens).__name__,
       "model_weights_mb": round(m["model_weights"] / 1e6, 1), "prepacked_mb": round(m["prepacked_weights"] / 1e6, 1),
       "peak_rss_after_load_mb": round(rss_load), "peak_rss_after_generate_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
       "rss_after_generate_mb": rss_now, "tokens_sha": hashlib.sha1(str(tokens).encode()).hexdigest()[:12], "tokens": tokens}
del llm, outs
if ppl_tokens:
    from tokenmill.quantization.ppl import evaluate
    r = evaluate(model, max_tokens=ppl_tokens, context_len=512, kl_base="same" if variant != "fp32" else None,
                 cpu_gemm_dtype=gemm)
    out.update(perplexity=r["perplexity"], kl_vs_fp32=r.get("kl_divergence"), ppl_tokens=r["num_tokens"])
print(json.dumps(out))
