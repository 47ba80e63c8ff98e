# usage: python decode_attention.py [CFLAGS..]: tm_paged_attention at batched decode, 30 layers of caches, us per layer and GB/s of K/V read; extra flags rebuild the kernels with them
# batched decode attention at SmolLM2's shape, 30 layers' caches (read from memory as in a step)
import sys, time, torch, ctypes, tempfile
sys.path.insert(0, "/work/main")
from tokenmill.layers import cpu_ops, native
from tokenmill.layers.attention.metadata import AttentionMetadata
torch.set_num_threads(2)
extra = sys.argv[1:]  # extra compiler flags, e.g. -DATT_SPLIT_MIN=100000
if extra:
    lib = native.declare(ctypes.CDLL(native.build_shared_library(native.SOURCE, tempfile.mkdtemp(), native.build_flags() + extra)))
    native.library = lambda: lib
g = torch.Generator().manual_seed(0)
hq, hkv, d, bs = 9, 3, 64, int(__import__("os").environ.get("BS", 16))
for B, ctx in [(32, 192), (32, 256), (8, 512)]:
    per = -(-ctx // bs); nb = B * per + 8
    layers = [(torch.randn(nb, bs, hkv, d, generator=g), torch.randn(nb, bs, hkv, d, generator=g)) for _ in range(30)]
    perm = torch.randperm(nb, generator=g).tolist()
    tables = [perm[i * per:(i + 1) * per] for i in range(B)]
    meta = AttentionMetadata.build([1] * B, [ctx] * B, tables, bs, "cpu")
    q = torch.randn(B, hq, d, generator=g); out = torch.empty_like(q)
    ql = torch.tensor([1] * B)
    def step():
        for kc, vc in layers:
            cpu_ops.paged_attention(q, kc, vc, meta.block_tables, meta.query_start_loc[:-1], ql, meta.seq_lens, 0.125, None, out)
    step()
    ts = []
    for _ in range(7):
        t0 = time.perf_counter(); step(); ts.append((time.perf_counter() - t0) / 30 * 1e6)
    ts.sort()
    gb = B * ctx * hkv * d * 4 * 2 / 1e9
    print(" ".join(extra) or "default", f"B{B} ctx{ctx}: {ts[3]:.0f} us/layer, {gb / (ts[3] * 1e-6):.1f} GB/s", flush=True)
