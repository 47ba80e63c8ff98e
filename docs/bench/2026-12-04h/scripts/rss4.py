# usage: python rss4.py GGUF CTX: one CTX-token prompt + 64 tokens, VmRSS polled during generate; peak, its stack, and the time (MALLOC_MMAP_THRESHOLD_ to try glibc settings)
import sys, os, threading, time, traceback, random
def rss_kb():
    for l in open("/proc/self/status"):
        if l.startswith("VmRSS"): return int(l.split()[1])
import torch
torch.set_num_threads(2)
sys.path.insert(0, os.environ.get("TREE", "/work/main"))
from tokenmill import LLM, SamplingParams
ctx = int(sys.argv[2])
llm = LLM(model=sys.argv[1], quantization="gguf", quant_activations="q8", kv_cache_dtype="fp16", num_threads=2,
          skip_tokenizer_init=True, max_model_len=ctx + 72, max_num_seqs=1, max_num_batched_tokens=2048,
          block_size=16, num_kv_blocks=(ctx + 72) // 16 + 2, enable_prefix_caching=False)
print("loaded", rss_kb() // 1024)
main = threading.main_thread().ident
peak = [0, None]
done = False
def poll():
    while not done:
        r = rss_kb()
        if r > peak[0]:
            peak[0] = r; peak[1] = "".join(traceback.format_stack(sys._current_frames()[main])[-8:])
        time.sleep(0.001)
t = threading.Thread(target=poll, daemon=True); t.start()
rng = random.Random(0)
p = [rng.randrange(100, 200000) for _ in range(ctx)]
t0 = time.time(); llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
print("gen s", round(time.time() - t0, 2)); done = True; t.join()
print("peak", peak[0] // 1024, "MB; now", rss_kb() // 1024); print(peak[1])
