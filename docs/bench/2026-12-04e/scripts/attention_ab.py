# usage: python attention_ab.py TREE LABEL  (A/B of tm_paged_attention builds: run once per tree, alternating)
import sys, time, torch
sys.path.insert(0, sys.argv[1])
from tokenmill.layers import cpu_ops
from tokenmill.layers.attention.metadata import AttentionMetadata
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
hq, hkv, d, bs, nb = 9, 3, 64, 16, 2400
kc, vc = torch.randn(nb, bs, hkv, d, generator=g), torch.randn(nb, bs, hkv, d, generator=g)
res = []
for B, ql, ctx in [(1, 1, 2048), (1, 4, 2048), (1, 1, 200), (2, 4, 512), (8, 1, 512), (8, 4, 512), (32, 1, 256)]:
    perm = torch.randperm(nb, generator=g).tolist()
    per = -(-ctx // bs); tables = [perm[i * per:(i + 1) * per] for i in range(B)]
    meta = AttentionMetadata.build([ql] * B, [ctx] * B, tables, bs, "cpu")
    q = torch.randn(B * ql, hq, d, generator=g); out = torch.empty_like(q)
    args = (q, kc, vc, meta.block_tables, meta.query_start_loc[:-1], torch.tensor([ql] * B), meta.seq_lens, 0.125, None, out)
    for _ in range(20): cpu_ops.paged_attention(*args)
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(50): cpu_ops.paged_attention(*args)
        ts.append((time.perf_counter() - t0) / 50 * 1e6)
    ts.sort(); res.append(f"B{B} q{ql} ctx{ctx}: {ts[3]:.1f}us")
print(sys.argv[2], " | ".join(res))
