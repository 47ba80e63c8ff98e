"""Decode attention phases by subtraction: full kernel, without the values pass, without the score
dot products (SmolLM2 heads, fp16, sequential tables, 30 layers' caches, 2 threads)."""
import os, statistics, time
import torch
from tokenmill.layers import native
from builds import library
torch.manual_seed(0); torch.set_num_threads(2)
hq, hkv, d, bs = 9, 3, 64, 16
SOFTMAX = "    softmax_rows(scores, Hq, n, stats, stats + Hq);\n    memset(o, 0, sizeof(float) * (size_t)(Hq * D));\n"
DOTS = "        for (int64_t h0 = 0, h1; h0 < Hq; h0 = h1) {   /* heads of one KV head, ATT_HB at a time */"
source = open(os.path.join(os.path.dirname(native.SOURCE), "cpu_attention.c")).read()
assert SOFTMAX in source and DOTS in source
variants = {"full": source,
            # return after the softmax: no values pass
            "no_values": source.replace(SOFTMAX, SOFTMAX + "    if (n > 0) return;\n", 1),
            # every score 0, no dot products (the key walk and its prefetch stay)
            "no_dots": source.replace(DOTS, "        for (int64_t h = 0; h < Hq; h++) for (int r = 0; r < 4; r++) "
                                            "scores[h * n + j + r] = 0.0f;\n        if (n > 0) continue;\n" + DOTS, 1)}
libs = {name: library({"cpu_attention.c": text}) for name, text in variants.items()}
for ctx in (2048, 4096):
    nblk = ctx // bs + 1; L = 30
    kc = [torch.randn(nblk + 8, bs, hkv, d).half() for _ in range(L)]
    vc = [torch.randn(nblk + 8, bs, hkv, d).half() for _ in range(L)]
    table = torch.arange(nblk).to(torch.int64).reshape(1, -1).contiguous()
    q = torch.randn(1, hq, d); out = torch.empty(1, hq, d)
    qs, ql, sl = torch.tensor([0]), torch.tensor([1]), torch.tensor([ctx])
    def run(lib, layers):
        for l in layers:
            lib.tm_paged_attention(q.data_ptr(), q.stride(0), hq, d, kc[l].data_ptr(), vc[l].data_ptr(), None, None,
                                   2, bs, hkv, table.data_ptr(), table.shape[1], 1, qs.data_ptr(), ql.data_ptr(),
                                   sl.data_ptr(), None, d ** -0.5, 0, out.data_ptr(), 2)
    for label, layers in (("30 layers (memory)", range(L)), ("layer 0 x30 (cache)", [0] * L)):
        t = {n: [] for n in libs}
        for _ in range(20):
            for n, lib in libs.items():
                t0 = time.perf_counter(); run(lib, layers); t[n].append(time.perf_counter() - t0)
        print(f"ctx {ctx} {label}: " + "  ".join(f"{n} {statistics.median(v)*1e3:.2f} ms" for n, v in t.items()), flush=True)
