# one prefill_attention call (one layer) of T rows, float32 kernel vs bf16 tiles, bf16 cache; usage: prefill_attention_call.py HQ HKV D T
import torch, time
from tokenmill.layers import cpu_ops
torch.manual_seed(0)
import sys
Hq, Hkv, D, T, bs = [int(a) for a in sys.argv[1:5]] + [16]
nb = T // bs
kc = torch.randn(nb, bs, Hkv, D).bfloat16(); vc = torch.randn(nb, bs, Hkv, D).bfloat16()
bt = torch.arange(nb).view(1, -1).contiguous()
q = torch.randn(T, Hq, D); out = torch.empty_like(q)
one = lambda a: torch.tensor([a], dtype=torch.int64)
for bf16 in (False, True, False, True):
    cpu_ops.prefill_attention(q, kc, vc, bt, one(0), one(T), one(T), 0.125, None, out, bf16_math=bf16)
    s = time.perf_counter()
    for _ in range(10): cpu_ops.prefill_attention(q, kc, vc, bt, one(0), one(T), one(T), 0.125, None, out, bf16_math=bf16)
    print("bf16" if bf16 else "fp32", "%.2f ms" % ((time.perf_counter() - s) / 10 * 1e3))
