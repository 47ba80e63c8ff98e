# usage: ctx_ab.py CTX [LLM kwargs]: batch-1 decode tok/s after a CTX-token prompt (prefix-cached), best of 3; LIB=path/lib.so swaps the kernel library
# batch-1 decode tok/s after a long prompt; LIB=path swaps the kernel library
import os, sys, time, ctypes, torch
from tokenmill import LLM, SamplingParams
if os.environ.get("LIB"):
    from tokenmill.layers import native
    _l = native.declare(ctypes.CDLL(os.environ["LIB"])); native.library = lambda: _l
ctx = int(sys.argv[1]); kw = eval(sys.argv[2]) if len(sys.argv) > 2 else {}
llm = LLM(model="smollm2-135m", max_model_len=ctx + 200, enable_prefix_caching=True, **kw)
g = torch.Generator().manual_seed(0)
p = {"prompt_token_ids": torch.randint(100, 40000, (ctx,), generator=g).tolist()}
llm.generate([p], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)  # prefill, cached
best = 0
for r in range(3):
    t = time.perf_counter(); llm.generate([p], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False); t1 = time.perf_counter() - t
    t = time.perf_counter(); llm.generate([p], SamplingParams(temperature=0, max_tokens=66, ignore_eos=True), use_tqdm=False); t2 = time.perf_counter() - t
    best = max(best, 64 / (t2 - t1))
print(os.path.basename(os.path.dirname(os.environ.get("LIB", "x/main"))), ctx, kw, "decode tok/s %.1f" % best)
