"""Two EAGLE-3 drafters at T = 1 in one process, interleaved: plain decoding, then each drafter
(int8, prompt lookup first, fixed k) as a chain and with a draft tree, on the first 16 of
`bench spec`'s chat prompts one at a time (batch 1), 96 tokens each, seeded; ROUNDS rounds.
Prints tok/s and the ratio to plain per round, the medians, and each engine's acceptance by
position. Outputs are checked equal to plain's (seeded sampling is exact).
usage: python ab_eagle3_t1.py OLD_DIR NEW_DIR K TREE [ROUNDS] [TEMPERATURE]"""
import sys
from tokenmill import LLM, SamplingParams
from tokenmill.spec.bench import _prompts
from interleave import report, run_rounds

old, new, k, tree = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 3
temp = float(sys.argv[6]) if len(sys.argv) > 6 else 1.0
base = dict(model="smollm2-135m", num_threads=2, max_model_len=2048, max_num_seqs=1)


def spec(d, with_tree):
    s = dict(method="eagle3", model=d, quantization="int8", num_speculative_tokens=k, adaptive=False,
             ngram_first=True, prompt_lookup_min=2, prompt_lookup_max=4)
    return dict(s, speculative_token_tree=tree) if with_tree else s


engines = {"plain": LLM(**base)}
for name, d in (("old", old), ("new", new)):
    engines[name + "_chain"] = LLM(**base, speculative_config=spec(d, False))
    engines[name + "_tree"] = LLM(**base, speculative_config=spec(d, True))
prompts, _ = _prompts(engines["plain"].engine.tokenizer, "chat", 16, "sharegpt")
params = [SamplingParams(temperature=temp, seed=i, max_tokens=96) for i in range(len(prompts))]
report(engines, run_rounds(engines, prompts, params, rounds), f"T={temp} k={k} tree={tree}")
