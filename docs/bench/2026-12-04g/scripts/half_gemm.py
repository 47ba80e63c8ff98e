# usage: python half_gemm.py: float32 kernel (cpu_ops.linear; F.linear past 64 rows, i.e. oneDNN) vs 16-bit weights (cpu_ops.linear_half) on SmolLM2 shapes, W from memory (~600 MB of copies), 2 threads
import torch, time, sys
from tokenmill.layers import cpu_ops, native
def bench(fn, reps=10):
    fn(); t=time.perf_counter()
    for _ in range(reps): fn()
    return (time.perf_counter()-t)/reps
shapes=[(960,576),(3072,576),(576,1536),(49152,576)]
for (n,k) in shapes:
    copies=max(2, int(600e6/(n*k*4)))
    ws=[torch.randn(n,k) for _ in range(copies)]
    hs=[w.to(torch.bfloat16) for w in ws]
    for m in (1,8,32,64,512):
        x=torch.randn(m,k)
        i=[0]
        def f32():
            i[0]=(i[0]+1)%copies
            if m<=64: cpu_ops.linear(x,ws[i[0]])
            else: torch.nn.functional.linear(x,ws[i[0]])
        def h16():
            i[0]=(i[0]+1)%copies; cpu_ops.linear_half(x,hs[i[0]])
        t1=bench(f32); t2=bench(h16)
        fl=2*m*n*k
        print(n,k,m, "f32 %.0f us %.0f GF"%(t1*1e6, fl/t1/1e9), "bf16w %.0f us %.0f GF  ratio %.2f"%(t2*1e6, fl/t2/1e9, t1/t2), flush=True)
