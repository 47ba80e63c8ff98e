# usage: steps_ab.py float32|bfloat16 [LLM kwargs]: 32 random 128-token prompts, prefill seconds and ms per decode step at 32 sequences (no prefix cache); LIB=path/lib.so swaps the kernel library; prints the peak RSS last (run with PYTHONPATH=TREE to measure another checkout)
import sys, time, torch
from tokenmill import LLM, SamplingParams
import os, ctypes
if os.environ.get("LIB"):
    from tokenmill.layers import native
    _l = native.declare(ctypes.CDLL(os.environ["LIB"])); native.library = lambda: _l
dt = sys.argv[1]; kw = eval(sys.argv[2]) if len(sys.argv) > 2 else {}
llm = LLM(model="smollm2-135m", cpu_gemm_dtype=dt, max_num_seqs=32, enable_prefix_caching=False, **kw)
g = torch.Generator().manual_seed(0)
prompts = [{"prompt_token_ids": torch.randint(100, 40000, (128,), generator=g).tolist()} for _ in range(32)]
llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
for r in range(2):
    res = {}
    for n in (1, 129):
        t = time.perf_counter(); llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        res[n] = time.perf_counter() - t
    print(dt, kw, "prefill s %.2f decode ms/step %.1f total tok/s(128) %.0f" % (res[1], (res[129]-res[1])/128*1e3, 32*128/(res[129])))
import resource; print("peak RSS MB %.0f" % (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
