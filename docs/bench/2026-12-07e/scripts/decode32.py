# 32 x 128-token prompts prefix-cached, then 128 decode steps at 32 sequences; usage: decode32.py DTYPE|gguf-q8 ISA [profile|- [KV_CACHE_DTYPE [HUGE_PAGES 0/1]]]
import sys, time, torch, cProfile, pstats
from tokenmill import LLM, SamplingParams
dt, isa = sys.argv[1], sys.argv[2]
# DTYPE gguf-q8 (added in 2026-12-07h): the SmolLM2 GGUF as gguf-q8 instead of the HF weights
if dt == "gguf-q8":
    import glob, os
    model = glob.glob(os.path.expanduser("~/.cache/tokenmill/smollm2-135m/*.gguf"))[0]
    kw = dict(quantization="gguf", quant_activations="q8", skip_tokenizer_init=True)
else:
    model, kw = "smollm2-135m", dict(cpu_gemm_dtype=dt)
# HUGE_PAGES (added in 2026-12-07i): ModelConfig.huge_pages, default on
huge = bool(int(sys.argv[5])) if len(sys.argv) > 5 else True
llm = LLM(model=model, **kw, cpu_isa=isa, max_num_seqs=32, enable_prefix_caching=True, num_threads=2, kv_cache_dtype=(sys.argv[4] if len(sys.argv) > 4 else "auto"), huge_pages=huge)
g = torch.Generator().manual_seed(0)
prompts = [{"prompt_token_ids": torch.randint(100, 40000, (128,), generator=g).tolist()} for _ in range(32)]
llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
sp = SamplingParams(temperature=0, max_tokens=129, ignore_eos=True)
for r in range(4):
    t = time.perf_counter(); llm.generate(prompts, sp, use_tqdm=False)
    s = time.perf_counter() - t; print(dt, isa, "decode ms/step %.2f" % (s / 128 * 1e3), flush=True)
if len(sys.argv) > 3 and sys.argv[3] == "profile":
    pr = cProfile.Profile(); pr.enable(); llm.generate(prompts, sp, use_tqdm=False); pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
