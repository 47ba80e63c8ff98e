"""Two DFlash drafters against plain decoding in one process, interleaved: the trained drafters
(int8) with a fixed block (k drafts) and with adaptive k, on the first 16 of `bench spec`'s chat
prompts (ShareGPT's benchmark split) one at a time (batch 1), 96 greedy tokens each; 3 rounds,
each engine once per round. Prints each engine's tok/s and ratio to
plain per round, the medians, and each drafter's tau (tokens per verify step). Outputs are
checked equal to plain's.
usage: python ab_dflash.py OLD_DIR NEW_DIR K"""
import statistics, sys, time
from tokenmill import LLM, SamplingParams
from tokenmill.spec.bench import _prompts

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
speed = {n: [] for n in engines}
outs = {}
for rnd in range(3):
    for name, llm in engines.items():
        t, tokens = time.perf_counter(), 0
        got = []
        for p in prompts:
            o = llm.generate([p], params, use_tqdm=False)[0].outputs[0]
            tokens += len(o.token_ids)
            got.append(o.token_ids)
        speed[name].append(tokens / (time.perf_counter() - t))
        outs[name] = got
    assert all(v == outs["plain"] for v in outs.values()), "outputs differ"
    print(f"round {rnd}: " + "  ".join(f"{n} {v[-1]:.1f}" for n, v in speed.items()), flush=True)
ratios = {n: statistics.median(a / b for a, b in zip(v, speed["plain"])) for n, v in speed.items()}
print(f"k={k}: " + "  ".join(f"{n} {statistics.median(speed[n]):.1f} tok/s ({ratios[n]:.3f}x)"
                             for n in engines))
for name, llm in engines.items():
    if name != "plain":
        s = llm.get_stats()
        n = max(s["spec_num_drafts"], 1)
        print(f"{name}: tau {s['spec_mean_acceptance_length']:.3f}  acceptance by position "
              f"{[round(a / n, 3) for a in s['spec_accepted_per_position']]}  k chosen {s['spec_k_chosen']}")
