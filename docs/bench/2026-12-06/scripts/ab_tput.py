# A/B of two kernel-library sources in one process: 32 x 128-token prompts, 64 tokens each (gguf-q8, fp16 KV), libraries swapped between runs. python ab_tput.py ISA MODEL [ROUNDS]
import sys, time, statistics, ctypes, random
# setup: the tokenmill/layers tree of each version copied to /tmp/src_old and /tmp/src_new (their kernel
# libraries are built from there into /tmp/build_old, /tmp/build_new); both run under one cpu_isa
from tokenmill.layers import native
isa, model = sys.argv[1], sys.argv[2]
native.use_isa(isa)
from tokenmill import LLM, SamplingParams
llm = LLM(model=model, quantization="gguf", quant_activations="q8", kv_cache_dtype="fp16", num_threads=2,
          skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=32, cpu_isa=isa, enable_prefix_caching=False)
libs = {n: native.declare(ctypes.CDLL(native.build_shared_library(f"/tmp/src_{n}/cpu_kernels.c", f"/tmp/build_{n}", native.build_flags())))
        for n in ("old", "new")}
rng = random.Random(0)
res = {n: [] for n in libs}
for r in range(int(sys.argv[3]) if len(sys.argv) > 3 else 3):
    ps = [[rng.randrange(100, 40000) for _ in range(128)] for _ in range(32)]
    for n, lib in libs.items():
        native._status.lib = lib
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
        res[n].append(32 * 64 / (time.perf_counter() - t))
print(f"{isa} {model} 32x128->64: " + "  ".join(f"{n} {statistics.median(v):.1f} tok/s ({' '.join(f'{x:.0f}' for x in v)})" for n, v in res.items()), flush=True)
