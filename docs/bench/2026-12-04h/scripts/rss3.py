# usage: [Q=bf16|fp16|none] python rss3.py GGUF: engine of 32 sequences, VmRSS polled every 2 ms while LLM() loads; prints the peak and the stack at it. Q unset: gguf-q8 (packed GGUF, q8 activations); else that quantization with float activations
import sys, os, threading, time, traceback
def rss_kb():
    for l in open("/proc/self/status"):
        if l.startswith("VmRSS"): return int(l.split()[1])
import torch
torch.set_num_threads(2)
sys.path.insert(0, os.environ.get("TREE", "/work/main"))
from tokenmill import LLM
main = threading.main_thread().ident
peak = [0, None]; log = []
def poll():
    while not done:
        r = rss_kb()
        if r > peak[0]:
            peak[0] = r
            peak[1] = "".join(traceback.format_stack(sys._current_frames()[main])[-12:])
        time.sleep(0.002)
done = False
t = threading.Thread(target=poll, daemon=True); t.start()
q = os.environ.get("Q")
quant = dict(quantization="gguf", quant_activations="q8") if q is None else dict(quantization=None if q == "none" else q)
llm = LLM(model=sys.argv[1], **quant, kv_cache_dtype="fp16", num_threads=2,
          skip_tokenizer_init=True, max_model_len=264, max_num_seqs=32, max_num_batched_tokens=2048,
          block_size=16, num_kv_blocks=32 * 17 + 1, enable_prefix_caching=False)
done = True; t.join()
print("peak", peak[0] // 1024, "MB; now", rss_kb() // 1024); print(peak[1])
