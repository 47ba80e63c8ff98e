# usage: python window_decode.py GGUF [CTX ...]: one engine with window pools and one without
# (sliding_window_pools=False), same model, same 2 GiB KV budget, gguf-q8 weights, fp16 KV,
# 2 threads. For each context: a random prompt of CTX tokens, then 64 greedy tokens; prints
# prefill and decode tok/s of each engine (alternating on / off, best of each round), the
# tokens being equal, the KV layout, and the KV blocks in use after the prompt.
import os, sys, time, random
import torch
torch.set_num_threads(2)
sys.path.insert(0, os.environ.get("TREE", "/work/main"))
from tokenmill import LLM, SamplingParams

path, ctxs = sys.argv[1], [int(c) for c in sys.argv[2:]] or [2048, 8192]
kw = dict(model=path, quantization="gguf", quant_activations="q8", kv_cache_dtype="fp16",
          num_threads=2, skip_tokenizer_init=True, max_model_len=max(ctxs) + 80,
          enable_prefix_caching=False)
# ORDER=off-first builds the one-table engine first (placement in memory follows build order)
order = ["off", "on"] if os.environ.get("ORDER") == "off-first" else ["on", "off"]
engines = {name: LLM(**kw, sliding_window_pools=(name == "on")) for name in order}
ROUNDS = int(os.environ.get("ROUNDS", "2"))
for name, llm in engines.items():
    m = llm.get_memory_stats()
    print(name, "groups", m["kv_groups"], "kv capacity tokens", m["kv_capacity_tokens"], flush=True)


def run(llm, prompt, n):
    engine = llm.engine
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    t0 = time.perf_counter(); first = None; held = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if first is None and outs and outs[0].outputs[0].token_ids:
            first = time.perf_counter()
            kv = engine.scheduler.kv
            held = [g.num_usable_blocks - g.num_free_blocks for g in kv.groups]
    end = time.perf_counter()
    return outs[0].outputs[0].token_ids, len(prompt) / (first - t0), (n - 1) / (end - first), held


rng = random.Random(0)
for ctx in ctxs:
    prompt = [rng.randrange(100, 200000) for _ in range(ctx)]
    best = {}
    for r in range(ROUNDS):
        for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
            tokens, pre, dec, held = run(engines[name], prompt, 64)
            b = best.setdefault(name, [tokens, 0, 0, held])
            b[1], b[2] = max(b[1], pre), max(b[2], dec)
    print(f"ctx {ctx}: tokens equal {best['on'][0] == best['off'][0]}; "
          + "; ".join(f"{n}: prefill {b[1]:.0f} tok/s, decode {b[2]:.1f} tok/s, blocks held per group {b[3]}"
                      for n, b in best.items())
          + f"; decode on/off {best['on'][2] / best['off'][2]:.3f}", flush=True)
