"""Chain against tree in one process, interleaved: plain decoding, the trained EAGLE-3 (int8)
with k drafts, and the same with a draft tree, on 8 chat prompts one at a time (batch 1),
seeded at temperature T; 5 rounds, each engine once per round. Prints the median tok/s of each
and its ratio to plain, per round and overall. Outputs are checked equal to plain's.
usage: python ab_tree_t1.py DRAFTER_DIR T K TREE [gguf-q8]   (the target's weights: fp32, or
GGUF q8 blocks with int8-rounded activations and an fp16 KV cache)"""
import statistics, sys, time
from tokenmill import LLM, SamplingParams

drafter, temp, k, tree = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
base = dict(model="smollm2-135m", num_threads=2, max_model_len=2048, max_num_seqs=1)
if sys.argv[5:] == ["gguf-q8"]:
    base.update(quantization="gguf", quant_activations="q8", kv_cache_dtype="fp16")
spec = dict(method="eagle3", model=drafter, quantization="int8", num_speculative_tokens=k, adaptive=False,
            ngram_first=True, prompt_lookup_min=2, prompt_lookup_max=4)
engines = {"plain": LLM(**base), "chain": LLM(**base, speculative_config=spec),
           "tree": LLM(**base, speculative_config=dict(spec, speculative_token_tree=tree))}
questions = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
             "Explain how a refrigerator works to a ten-year-old.",
             "What are the pros and cons of working from home?",
             "Give me a recipe for a simple vegetable soup.",
             "Describe the water cycle in a few paragraphs.",
             "Write a polite email asking my landlord to fix the heating.",
             "What should I pack for a week-long hiking trip?",
             "Summarize the causes of the French Revolution."]
prompts = [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in questions]
params = [SamplingParams(temperature=temp, seed=i, max_tokens=96) for i in range(len(prompts))]
speed = {n: [] for n in engines}
outs = {}
for rnd in range(5):
    for name, llm in engines.items():
        t, tokens = time.perf_counter(), 0
        got = []
        for p, sp in zip(prompts, params):
            o = llm.generate([p], sp, use_tqdm=False)[0].outputs[0]
            tokens += len(o.token_ids)
            got.append(o.token_ids)
        speed[name].append(tokens / (time.perf_counter() - t))
        outs[name] = got
    assert outs["chain"] == outs["plain"] and outs["tree"] == outs["plain"], "outputs differ"
    print(f"round {rnd}: " + "  ".join(f"{n} {v[-1]:.1f}" for n, v in speed.items()), flush=True)
med = {n: statistics.median(v) for n, v in speed.items()}
ratios = {n: statistics.median(a / b for a, b in zip(v, speed["plain"])) for n, v in speed.items()}
print(f"{sys.argv[5] if len(sys.argv) > 5 else 'fp32'} T={temp} k={k} tree={tree}: " + "  ".join(f"{n} {med[n]:.1f} tok/s ({ratios[n]:.3f}x)" for n in med))
