"""usage: [Q8=1] python first_steps.py WORKLOAD: per-step wall times of plain decoding at batch 8
(8 prompts, 96 tokens, 4 runs after a warm-up): are a run's first decode steps dearer than
the steady ones, and how many of them?"""
import os, sys, time, statistics
from tokenmill import LLM, SamplingParams
from tokenmill.spec import bench as B

q8 = os.environ.get("Q8") == "1"
llm = LLM(model="smollm2-135m", num_threads=2, max_num_seqs=8, kv_cache_memory=1024 * 1024**2,
          quantization="gguf" if q8 else None, quant_activations="q8" if q8 else "fp32")
eng = llm.engine
prompts, _ = B._prompts(eng.tokenizer, sys.argv[1], 8, "sharegpt")
params = [SamplingParams(temperature=0, max_tokens=96, ignore_eos=True) for _ in range(8)]
steps = []
orig = eng.step
def step():
    t = time.perf_counter(); r = orig(); steps.append((time.perf_counter() - t, eng.runner.last_num_tokens if hasattr(eng.runner, "last_num_tokens") else None)); return r
eng.step = step
runs = []
for rep in range(5):
    steps.clear()
    B._generate(llm, B._salted(prompts, None, f"r{rep}"), params)
    runs.append([s for s, _ in steps])
for run in runs[1:]:
    steady = statistics.median(run[20:80])
    print(f"steps {len(run)} steady median {1000 * steady:.2f} ms; first 10 / steady:",
          " ".join(f"{s / steady:.2f}" for s in run[:10]))
