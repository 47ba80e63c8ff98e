"""The C paged-attention kernel alone (cpu_ops.paged_attention, chains: no q_pos), for an
old / new A/B in alternating processes (PYTHONPATH picks the tree). SmolLM2's shape (9 query
heads, 3 KV heads, 64 dims), 2 threads: one row over 3000 fp16 keys (split over threads),
and 16 rows over 200 fp32 keys. Prints the median microseconds of each.
usage: PYTHONPATH=TREE python ab_attention_kernel.py LABEL"""
import statistics, sys, time
import torch
from tokenmill.layers import cpu_ops
torch.set_num_threads(2)
torch.manual_seed(0)
res = []
for dtype, B, ctx in ((torch.float16, 1, 3000), (torch.float32, 16, 200)):
    bs, blocks_per = 16, -(-ctx // 16)
    k = torch.randn(B * blocks_per + 1, bs, 3, 64).to(dtype)
    v = torch.randn_like(k)
    tables = torch.arange(1, B * blocks_per + 1).view(B, blocks_per)
    q = torch.randn(B, 9, 64)
    out = torch.empty_like(q)
    q_start, q_len = torch.arange(B), torch.ones(B, dtype=torch.int64)
    seq_len = torch.full((B,), ctx, dtype=torch.int64)
    call = lambda: cpu_ops.paged_attention(q, k, v, tables, q_start, q_len, seq_len, 0.125, None, out)
    assert call()
    times = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(200):
            call()
        times.append((time.perf_counter() - t) / 200 * 1e6)
    res.append(statistics.median(times))
print(sys.argv[1], f"b1 ctx3000 fp16 {res[0]:.1f} us  b16 ctx200 fp32 {res[1]:.1f} us", flush=True)
