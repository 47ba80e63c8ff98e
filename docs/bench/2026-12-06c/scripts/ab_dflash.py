"""Two DFlash drafters against plain decoding in one process, interleaved: the trained drafters
(int8) with a fixed block (k drafts) and with adaptive k, on the first 16 of `bench spec`'s chat
prompts (ShareGPT's benchmark split) one at a time (batch 1), 96 greedy tokens each; 3 rounds,
each engine once per round. Prints each engine's tok/s and ratio to
plain per round, the medians, and each drafter's tau (tokens per verify step). Outputs are
checked equal to plain's.
usage: python ab_dflash.py OLD_DIR NEW_DIR K"""
import sys
from tokenmill import LLM, SamplingParams
from tokenmill.spec.bench import _prompts
from interleave import report, run_rounds

old, new, k = sys.argv[1], sys.argv[2], int(sys.argv[3])
base = dict(model="smollm2-135m", num_threads=2, max_model_len=2048, max_num_seqs=1)


def spec(d, adaptive):
    return dict(method="dflash", model=d, quantization="int8", num_speculative_tokens=k, adaptive=adaptive)


engines = {"plain": LLM(**base)}
for name, d in (("old", old), ("new", new)):
    engines[name] = LLM(**base, speculative_config=spec(d, False))
    engines[name + "_adaptive"] = LLM(**base, speculative_config=spec(d, True))
prompts, _ = _prompts(engines["plain"].engine.tokenizer, "chat", 16, "sharegpt")
params = SamplingParams(temperature=0, max_tokens=96)
report(engines, run_rounds(engines, prompts, [params] * len(prompts), 3), f"k={k}")
