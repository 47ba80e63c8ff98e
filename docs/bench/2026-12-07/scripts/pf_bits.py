"""Old cpu_prefill.c (HEAD) against the working tree's: outputs torch.equal on many shapes."""
import sys, subprocess, torch
sys.path.insert(0, "docs/bench/2026-12-06f/scripts"); sys.path.insert(0, "tests/layers")
from builds import library
from tokenmill.layers import native
import test_prefill_attention as T
old = library({"cpu_prefill.c": subprocess.run(["git", "show", "HEAD:tokenmill/layers/cpu_prefill.c"], capture_output=True, text=True).stdout})
new = native.library()
n = 0
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for hq, hkv, d in ((9, 3, 64), (4, 1, 256), (8, 1, 48), (4, 4, 32), (16, 2, 128)):
        for window in (None, 37, 512):
            g = torch.Generator().manual_seed(hq * d + 1)
            k, v, perm = T._cache(hkv, d, dtype, g, nblocks=120)
            q_lens, seq_lens = [50, 9, 130, 17, 400], [50, 100, 300, 17, 900]
            tables = T._tables(seq_lens, perm)
            q = torch.randn(sum(q_lens), hq, d, generator=g)
            outs = []
            for lib in (old, new):
                native.library = lambda lib=lib: lib
                outs.append(T._run(q, k, v, q_lens, seq_lens, tables, window))
            assert torch.equal(outs[0], outs[1]), (dtype, hq, hkv, d, window, (outs[0] - outs[1]).abs().max())
            n += 1
print("identical on", n, "cases")
