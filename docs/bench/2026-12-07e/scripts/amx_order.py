import torch, numpy as np
from tokenmill.layers import cpu_ops, native
lib = native.library()
torch.manual_seed(1)
def amx(x, w):
    lib.tm_amx_enable(1)
    return cpu_ops.linear_bf16(x, cpu_ops.bf16_tiles(w), None).numpy()
M, K = 4096, 32
x = torch.randn(M, K); w = torch.randn(16, K)
y = amx(x, w)
P = (x.to(torch.bfloat16).double().numpy()[:, None, :] * w.to(torch.bfloat16).double().numpy()[None, :, :])  # M,N,K exact products
def rne(a): return a.astype(np.float32).astype(np.float64)
def rtz(a):
    f = a.astype(np.float32)
    over = np.abs(f.astype(np.float64)) > np.abs(a)
    f = np.where(over, np.nextafter(f, np.float32(0)), f)
    return f.astype(np.float64)
def tree(v, r):  # v [..., n] pairwise tree
    while v.shape[-1] > 1:
        v = r(v[..., 0::2] + v[..., 1::2])
    return v[..., 0]
def tree_adj(v, r):  # adjacent halves tree
    while v.shape[-1] > 1:
        h = v.shape[-1] // 2
        v = r(v[..., :h] + v[..., h:])
    return v[..., 0]
c = {}
for rn, r in (("rne", rne), ("rtz", rtz)):
    c[f"tree interleaved {rn}"] = tree(P, r)
    c[f"tree halves {rn}"] = tree_adj(P, r)
    c[f"exact sum {rn}"] = r(P.sum(-1))
    pairs = r(P[..., 0::2] + P[..., 1::2])
    acc = np.zeros(P.shape[:2])
    for p in range(16): acc = r(acc + pairs[..., p])
    c[f"pair-rounded chain {rn}"] = acc
    acc = np.zeros(P.shape[:2])
    for p in range(16): acc = r(acc + P[..., 2*p] + P[..., 2*p+1])
    c[f"pair fused chain {rn}"] = acc
    c[f"pairs then tree {rn}"] = tree(pairs, r)
for n, v in c.items():
    d = (v.astype(np.float32) != y)
    print(f"{n:30s} match {1-d.mean():.4f}")
# ulps of exact
ex = P.sum(-1)
err = np.abs(y - ex)
print("max err vs exact", err.max(), "mean", err.mean())
def amx_doc(P, r, group=16):
    acc = np.zeros(P.shape[:2])
    for p0 in range(0, P.shape[-1] // 2, group):
        e = np.zeros(P.shape[:2]); o = np.zeros(P.shape[:2])
        for p in range(p0, p0 + group):
            e = r(e + P[..., 2*p]); o = r(o + P[..., 2*p+1])
        acc = r(acc + r(e + o))
    return acc
v = amx_doc(P, rne)
print("doc even/odd chains:", (v.astype(np.float32) == y).mean())
for K in (64, 576):
    x = torch.randn(1024, K); w = torch.randn(16, K)
    y2 = amx(x, w)
    P2 = (x.to(torch.bfloat16).double().numpy()[:, None, :] * w.to(torch.bfloat16).double().numpy()[None, :, :])
    print(K, "doc:", (amx_doc(P2, rne).astype(np.float32) == y2).mean())
