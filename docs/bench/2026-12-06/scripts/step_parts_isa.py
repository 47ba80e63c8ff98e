# step_parts.py of ../../2026-12-05g with a cpu_isa argument: python step_parts_isa.py MODEL [native|avx2]
"""usage: python step_parts.py [MODEL]: batch-1 gguf-q8 (fp16 KV) decode, 300 tokens after a
128-token prompt; median ms per step of each part (wrapped with perf_counter), 3 runs."""
import random, statistics, sys, time, collections
from tokenmill.layers import native as _n
_n.use_isa(sys.argv[2] if len(sys.argv) > 2 else "native")
from tokenmill import LLM, SamplingParams
from tokenmill.layers import native
from tokenmill.layers.quant import qgemm
from tokenmill.runner import model_runner, fused_stack

model = sys.argv[1] if len(sys.argv) > 1 else "gemma3-270m"
llm = LLM(model=model, quantization="gguf", quant_activations="q8", kv_cache_dtype="fp16",
          num_threads=2, skip_tokenizer_init=True, max_model_len=2048, max_num_seqs=1, cpu_isa=sys.argv[2] if len(sys.argv) > 2 else "native")
eng = llm.engine
runner = eng.runner
acc = collections.defaultdict(float)
def timed(key, f):
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[key] += time.perf_counter() - t; return r
    return g
lib = native.library()
class TimedC:
    def __init__(self, f): self.f = f
    def __call__(self, *a):
        t = time.perf_counter(); r = self.f(*a); acc["c_stack"] += time.perf_counter() - t; return r
lib.tm_llama_decode = TimedC(lib.tm_llama_decode)
qgemm.qgemm_q8 = timed("head_q8", qgemm.qgemm_q8)
model_runner.build_model_input = timed("build_input", model_runner.build_model_input)
fused_stack.run_layers = timed("run_layers(py+c)", fused_stack.run_layers)
runner._forward = timed("forward(all)", runner._forward)
runner._sample = timed("sample", runner._sample)
runner.model.compute_logits = timed("compute_logits", runner.model.compute_logits)
runner.model.embed = timed("embed", runner.model.embed)
runner.execute = timed("execute", runner.execute)
rows = []
orig_step = eng.step
def step():
    acc.clear()
    t = time.perf_counter(); r = orig_step(); acc["step"] = time.perf_counter() - t
    rows.append(dict(acc)); return r
eng.step = step
rng = random.Random(0)
for rep in range(4):
    rows.clear()
    p = [rng.randrange(100, 40000) for _ in range(128)]
    llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True), use_tqdm=False)
    if rep:
        dec = rows[2:]
        print("  ".join(f"{k} {1000 * statistics.median(r.get(k, 0) for r in dec):.3f}" for k in dec[0]))
