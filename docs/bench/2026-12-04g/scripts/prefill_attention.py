# usage: python prefill_attention.py: tm_prefill_attention vs the SDPA path (_prefill_one) per layer, SmolLM2 shape, 2 threads
import torch, sys, time
sys.path.insert(0, __import__("os").environ.get("TREE", "/work/main"))
from tokenmill.layers import cpu_ops
from tokenmill.layers.attention import cpu as cpu_backend
from tokenmill.layers.attention.metadata import AttentionMetadata
torch.set_num_threads(2)
torch.manual_seed(0)
hq, hkv, d, bs = 9, 3, 64, 16
for q_lens in ([512], [128] * 16, [2048]):
    seq_lens = q_lens
    nb = sum(-(-s // bs) for s in seq_lens) + 4
    kc = torch.randn(nb, bs, hkv, d); vc = torch.randn(nb, bs, hkv, d)
    perm = torch.randperm(nb).tolist()
    tables, used = [], 0
    for s in seq_lens:
        n = -(-s // bs); tables.append(perm[used:used + n]); used += n
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, bs, "cpu")
    q = torch.randn(sum(q_lens), hq, d); k = torch.randn(sum(q_lens), hkv, d); v = torch.randn(sum(q_lens), hkv, d)
    out = torch.empty_like(q)
    def kern():
        cpu_ops.prefill_attention(q, kc, vc, meta.block_tables, meta.query_start_loc[:-1], torch.tensor(q_lens), meta.seq_lens, 0.125, None, out)
    def sdpa():
        st = 0
        for b, ql in enumerate(q_lens):
            out[st:st+ql] = cpu_backend._prefill_one(q[st:st+ql], k[st:st+ql], v[st:st+ql], kc, vc, meta.block_tables[b], seq_lens[b], 0.125, None, {})
            st += ql
    for f in (kern, sdpa): f()
    ts = {"kern": [], "sdpa": []}
    for _ in range(7):
        for name, f in (("kern", kern), ("sdpa", sdpa)):
            t0 = time.perf_counter(); f(); ts[name].append(time.perf_counter() - t0)
    med = {k2: sorted(v2)[3] * 1e3 for k2, v2 in ts.items()}
    print(q_lens[:2], len(q_lens), "kernel %.2f ms  sdpa %.2f ms  ratio %.2f" % (med["kern"], med["sdpa"], med["sdpa"] / med["kern"]), flush=True)
