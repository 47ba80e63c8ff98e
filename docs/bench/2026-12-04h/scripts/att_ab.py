# usage: att_ab.py DIR...: tm_paged_attention of each DIR/lib.so (build.sh), alternating, SmolLM2 shape; NL layers of caches (30: from memory), KVDT, CASES=BxCTX,..., CONTIG=1 for in-order blocks, HUGE=1 caches in madvise(MADV_HUGEPAGE) memory; us a layer and GB/s
import sys, time, torch, os, ctypes
sys.path.insert(0, os.environ.get("TREE", "/work/main"))
from tokenmill.layers import cpu_ops, native
from tokenmill.layers.attention.metadata import AttentionMetadata
torch.set_num_threads(2)
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
keep = []
def huge_empty(numel, dt):
    es = torch.tensor([], dtype=dt).element_size()
    raw = torch.empty(numel * es + (4 << 21), dtype=torch.uint8)
    p = raw.data_ptr(); a = (p + (1 << 21) - 1) & ~((1 << 21) - 1)
    assert libc.madvise(a, (numel * es + (1 << 21)) & ~((1 << 21) - 1), 14) == 0
    keep.append(raw)
    return raw[a - p: a - p + numel * es].view(dt)
libs = {d: native.declare(ctypes.CDLL(d + "/lib.so")) for d in sys.argv[1:]}
g = torch.Generator().manual_seed(0)
hq, hkv, d, bs = 9, 3, 64, 16
dt = getattr(torch, os.environ.get("KVDT", "float16"))
cases = [tuple(map(int, c.split("x"))) for c in os.environ.get("CASES", "1x8000,1x2048,8x1024,32x256").split(",")]
for B, ctx in cases:
    per = -(-ctx // bs); nb = B * per + 8
    def mk():
        t = torch.randn(nb, bs, hkv, d, generator=g).to(dt)
        if not os.environ.get("HUGE"): return t
        h = huge_empty(t.numel(), dt).view(t.shape); h.copy_(t); return h
    layers = [(mk(), mk()) for _ in range(int(os.environ.get("NL", 30)))]
    if os.environ.get("CONTIG"): perm = list(range(nb))
    else: perm = torch.randperm(nb, generator=g).tolist()
    tables = [perm[i * per:(i + 1) * per] for i in range(B)]
    meta = AttentionMetadata.build([1] * B, [ctx] * B, tables, bs, "cpu")
    q = torch.randn(B, hq, d, generator=g); outs = {k: torch.empty_like(q) for k in libs}
    ql = torch.tensor([1] * B)
    ts = {k: [] for k in libs}
    for r in range(7):
        for k, lib in libs.items():
            native.library = lambda lib=lib: lib
            t0 = time.perf_counter()
            for kc, vc in (layers * 30)[:30]:
                cpu_ops.paged_attention(q, kc, vc, meta.block_tables, meta.query_start_loc[:-1], ql, meta.seq_lens, 0.125, None, outs[k])
            ts[k].append((time.perf_counter() - t0) / 30)
    byts = B * 2 * ctx * hkv * d * torch.tensor([], dtype=dt).element_size()
    first = next(iter(outs.values()))
    print(f"{dt} B{B} ctx{ctx}: " + "  ".join(f"{os.path.basename(k)} {sorted(v)[3]*1e6:.0f}us {byts/sorted(v)[3]/1e9:.1f}GB/s" for k, v in ts.items()),
          "same" if all(torch.equal(first, o) for o in outs.values()) else "DIFF", flush=True)
