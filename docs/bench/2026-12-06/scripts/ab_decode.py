# A/B of two kernel-library sources in one process: decode at batch 1 and 4 (gguf-q8, fp16 KV), the
# library swapped between runs (every call site asks native.library() per call)
# setup: the tokenmill/layers tree of each version copied to /tmp/src_old and /tmp/src_new (their kernel
# libraries are built from there into /tmp/build_old, /tmp/build_new); both run under one cpu_isa
import sys, time, statistics, ctypes, random
from tokenmill.layers import native
isa, model = sys.argv[1], sys.argv[2]
native.use_isa(isa)
from tokenmill import LLM, SamplingParams
llm = LLM(model=model, quantization="gguf", quant_activations="q8", kv_cache_dtype="fp16", num_threads=2,
          skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=4, cpu_isa=isa)
libs = {n: native.declare(ctypes.CDLL(native.build_shared_library(f"/tmp/src_{n}/cpu_kernels.c", f"/tmp/build_{n}", native.build_flags())))
        for n in ("old", "new")}
rng = random.Random(0)
p = [rng.randrange(100, 40000) for _ in range(128)]
res = {n: [] for n in libs}
for batch in (1, 4):
    res = {n: [] for n in libs}
    for r in range(int(sys.argv[3]) if len(sys.argv) > 3 else 5):
        for n, lib in libs.items():
            native._status.lib = lib
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": p}] * batch, SamplingParams(temperature=0, max_tokens=129, ignore_eos=True), use_tqdm=False)
            res[n].append(batch * 128 / (time.perf_counter() - t))
    print(f"{isa} {model} batch {batch}: " + "  ".join(f"{n} {statistics.median(v):.1f} tok/s ({' '.join(f'{x:.0f}' for x in v)})" for n, v in res.items()), flush=True)
