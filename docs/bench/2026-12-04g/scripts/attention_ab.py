# usage: python attention_ab.py OLD_TREE: tm_paged_attention of OLD_TREE vs this tree, alternating, batched decode at SmolLM2 shape; NL=1 (one layer cache) or 30 (from memory); KVDT=float32|bfloat16
# A/B of tm_paged_attention: the library of a tree given as argv[1] (old) vs this tree's (new), alternating
import sys, time, torch, ctypes, tempfile, os
sys.path.insert(0, __import__("os").environ.get("TREE", "/work/main"))
from tokenmill.layers import cpu_ops, native
from tokenmill.layers.attention.metadata import AttentionMetadata
torch.set_num_threads(2)
libs = {"new": native.library(),
        "old": native.declare(ctypes.CDLL(native.build_shared_library(os.path.join(sys.argv[1], "tokenmill/layers/cpu_kernels.c"), tempfile.mkdtemp(), native.build_flags())))}
g = torch.Generator().manual_seed(0)
hq, hkv, d, bs = 9, 3, 64, 16
NL = int(os.environ.get("NL", 30))
dt = getattr(torch, os.environ.get("KVDT", "float32"))
for B, ctx in [(32, 192), (32, 256), (8, 512), (1, 2048)]:
    per = -(-ctx // bs); nb = B * per + 8
    layers = [(torch.randn(nb, bs, hkv, d, generator=g).to(dt), torch.randn(nb, bs, hkv, d, generator=g).to(dt)) for _ in range(NL)]
    perm = torch.randperm(nb, generator=g).tolist()
    tables = [perm[i * per:(i + 1) * per] for i in range(B)]
    meta = AttentionMetadata.build([1] * B, [ctx] * B, tables, bs, "cpu")
    q = torch.randn(B, hq, d, generator=g); outs = {k: torch.empty_like(q) for k in libs}
    ql = torch.tensor([1] * B)
    def step(name):
        native.library = lambda: libs[name]
        for kc, vc in (layers * 30)[:30]:
            cpu_ops.paged_attention(q, kc, vc, meta.block_tables, meta.query_start_loc[:-1], ql, meta.seq_lens, 0.125, None, outs[name])
    ts = {k: [] for k in libs}
    for r in range(9):
        for k in libs:
            t0 = time.perf_counter(); step(k); ts[k].append((time.perf_counter() - t0) / 30 * 1e6)
    same = torch.equal(outs["new"], outs["old"])
    med = {k: sorted(v)[4] for k, v in ts.items()}
    print(f"{os.environ.get('KVDT','float32')} NL{NL} B{B} ctx{ctx}: old {med['old']:.0f} us new {med['new']:.0f} us  ratio {med['old']/med['new']:.2f}  bits equal {same}", flush=True)
