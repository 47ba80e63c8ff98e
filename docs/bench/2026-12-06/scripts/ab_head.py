# A/B of two kernel-library sources on Gemma3's Q8_0 head (the model's own tiles), AVX2 build, alternating calls
# setup: the tokenmill/layers tree of each version copied to /tmp/src_old and /tmp/src_new (their kernel
# libraries are built from there into /tmp/build_old, /tmp/build_new); both run under one cpu_isa
import sys, time, statistics, ctypes, torch
from tokenmill.layers import native
native.use_isa("avx2")
from tokenmill import LLM
llm = LLM(model="gemma3-270m", quantization="gguf", quant_activations="q8", num_threads=2, skip_tokenizer_init=True, max_model_len=512, max_num_seqs=1, cpu_isa="avx2")
t = llm.engine.runner.model.model.embed_tokens._packed.tiled
libs = {}
for name in ("old", "new"):
    path = native.build_shared_library(f"/tmp/src_{name}/cpu_kernels.c", f"/tmp/build_{name}", native.build_flags())
    libs[name] = native.declare(ctypes.CDLL(path))
for rows in [int(a) for a in sys.argv[1:]] or (1, 2, 4, 8):
    x = torch.randn(rows, t.in_features)
    y = torch.empty(rows, t.out_features)
    res = {n: [] for n in libs}
    for r in range(12):
        for n, lib in libs.items():
            t0 = time.perf_counter()
            lib.tm_qgemm_q8(x.data_ptr(), rows, t.in_features, t.kind, t.qw.data_ptr(), t.sc.data_ptr(), None, t.group_size, t.out_features, y.data_ptr(), 2)
            res[n].append(time.perf_counter() - t0)
    print(f"rows {rows}: " + "  ".join(f"{n} {1e3 * statistics.median(v):.2f} ms" for n, v in res.items()), flush=True)
