# usage: python half_gemv_one_row.py: one activation row, float32 vs bf16 weights, GB/s of weight read (W from memory)
import torch, time, sys
from tokenmill.layers import cpu_ops
def bench(fn, reps=30):
    fn(); t=time.perf_counter()
    for _ in range(reps): fn()
    return (time.perf_counter()-t)/reps
res=[]
for (n,k) in [(3072,576),(49152,576)]:
    copies=max(2, int(800e6/(n*k*4)))
    ws=[torch.randn(n,k) for _ in range(copies)]
    hs=[w.to(torch.bfloat16) for w in ws]
    x=torch.randn(1,k)
    i=[0]
    def f32():
        i[0]=(i[0]+1)%copies; cpu_ops.linear(x,ws[i[0]])
    def h16():
        i[0]=(i[0]+1)%copies; cpu_ops.linear_half(x,hs[i[0]])
    for r in range(3):
        t1=bench(f32); t2=bench(h16)
        print(n,k,"f32 %.0f us %.1f GB/s   bf16 %.0f us %.1f GB/s"%(t1*1e6, n*k*4/t1/1e9, t2*1e6, n*k*2/t2/1e9), flush=True)
