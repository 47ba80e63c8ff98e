# where a B=1 gguf-q8 decode step goes outside the C calls: wrapped phases timed per step; usage: step_phases.py CTX NEW
import sys, time, torch, glob, os, collections
from tokenmill import LLM, SamplingParams
import tokenmill.layers.quant.qgemm as qg
from tokenmill.layers import native
import tokenmill.runner.model_runner as mr, tokenmill.runner.fused_stack as fs
ctx, new = int(sys.argv[1]), int(sys.argv[2])
gg = glob.glob(os.path.expanduser("~/.cache/tokenmill/smollm2-135m/*.gguf"))
llm = LLM(model=gg[0], quantization="gguf", quant_activations="q8", num_threads=2, kv_cache_dtype="fp16", max_model_len=ctx + new + 8, enable_prefix_caching=False, skip_tokenizer_init=True, block_size=16, num_kv_blocks=(ctx + new + 8) // 16 + 2)
acc = collections.Counter()
def wrap(name, f):
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[name] += time.perf_counter() - t; return r
    return g
e = llm.engine
lib = native.library(); lib.tm_llama_decode = wrap("C stack", lib.tm_llama_decode)
qg.qgemm_q8 = wrap("C head", qg.qgemm_q8)
sch = e.scheduler; sch.schedule = wrap("schedule", sch.schedule); sch.update_from_output = wrap("update", sch.update_from_output)
e.output_processor.process = wrap("output", e.output_processor.process)
ex = e.executor; ex.execute = wrap("execute", ex.execute)
R = mr.ModelRunner
for n in ["_update_states", "_forward", "_sample", "_aux_capture"]:
    setattr(R, n, wrap(n, getattr(R, n)))
mr.build_model_input = wrap("build_model_input", mr.build_model_input)
mr._nonfinite_rows = wrap("_nonfinite_rows", mr._nonfinite_rows)
fs.forward = wrap("fs.forward", fs.forward)
prompt = torch.randint(100, 40000, (ctx,), generator=torch.Generator().manual_seed(0)).tolist()
e.add_request(None, {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
e.step()
for _ in range(10): e.step()
acc.clear(); t = time.perf_counter(); n = 0
while e.has_unfinished_requests(): e.step(); n += 1
t = time.perf_counter() - t
print(f"ctx {ctx}: {n/t:.1f} tok/s, {t/n*1e3:.3f} ms/step")
for k, v in sorted(acc.items(), key=lambda kv: -kv[1]): print(f"  {k:20s} {v/n*1e3:.3f} ms")
