# B=1 decode after CTX prompt tokens on SmolLM2, huge pages on or off (ModelConfig.huge_pages);
# prints decode tok/s (steps after the prompt, the first 5 dropped), load time, RSS and AnonHugePages.
# usage: hugedec.py CTX NEW HUGE(0/1) [gguf-q8|fp32]
import sys, time, torch, glob, os
from tokenmill import LLM, SamplingParams
ctx, new, huge = int(sys.argv[1]), int(sys.argv[2]), bool(int(sys.argv[3]))
prec = sys.argv[4] if len(sys.argv) > 4 else "gguf-q8"
gg = glob.glob(os.path.expanduser("~/.cache/tokenmill/smollm2-135m/*.gguf"))
kw = dict(quantization="gguf", quant_activations="q8") if prec == "gguf-q8" else {}
t0 = time.time()
llm = LLM(model=gg[0] if prec == "gguf-q8" else "smollm2-135m", num_threads=2, kv_cache_dtype="fp16",
          max_model_len=ctx + new + 8, enable_prefix_caching=False, skip_tokenizer_init=True,
          huge_pages=huge, **kw)
load = time.time() - t0
prompt = torch.randint(100, 40000, (ctx,), generator=torch.Generator().manual_seed(0)).tolist()
e = llm.engine
e.add_request(None, {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
while next(iter(e.scheduler.requests.values())).num_computed_tokens < ctx:
    e.step()
times = []
while e.has_unfinished_requests():
    t = time.perf_counter(); e.step(); times.append(time.perf_counter() - t)
times = times[5:]
mem = {l.split(":")[0]: int(l.split()[1]) >> 10 for l in open("/proc/self/smaps_rollup") if l.startswith(("Rss", "AnonHugePages"))}
print(f"{prec} ctx {ctx} huge {int(huge)}: {len(times) / sum(times):.1f} tok/s, load {load:.1f} s, "
      f"RSS {mem['Rss']} MB, AnonHugePages {mem['AnonHugePages']} MB", flush=True)
