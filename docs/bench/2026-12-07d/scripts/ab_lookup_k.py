"""Prompt lookup first with its own draft length, next to the drafter's: fixed k, batch 1,
T = 0, in one process, interleaved. Variants: "L<a>E<b>": lookup up to a drafts where it
matches, EAGLE-3 (int8) b drafts elsewhere (k = max(a, b); the drafter's count capped by
wrapping its propose: what a separate lookup length would do); "ngram<a>": lookup alone.
bench spec's chat or grounded prompts (held-out ShareGPT), 8 of them one at a time, 96
tokens, R rounds, each engine once per round; prints tok/s per round and the median ratio to
plain. Outputs are checked equal to plain's.
usage: python ab_lookup_k.py EAGLE3_DIR chat|grounded ROUNDS VARIANT [VARIANT ...]"""
import re, statistics, sys, time
from tokenmill import LLM, SamplingParams
from tokenmill.spec.bench import _prompts

drafter, workload, rounds, variants = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
base = dict(model="smollm2-135m", num_threads=2, max_model_len=2048, max_num_seqs=1)
engines = {"plain": LLM(**base)}


def capped(inner, cap):
    def propose(inp):
        inp.num_drafts = [min(n, cap) for n in inp.num_drafts]
        return inner(inp)
    return propose


for v in variants:
    m = re.fullmatch(r"L(\d+)E(\d+)", v)
    if m:
        a, b = int(m[1]), int(m[2])
        llm = LLM(**base, speculative_config=dict(method="eagle3", model=drafter, quantization="int8",
                                                  adaptive=False, ngram_first=True,
                                                  num_speculative_tokens=max(a, b)))
        prop = llm.engine.runner.spec.proposer
        prop.lookup.propose = capped(prop.lookup.propose, a)
        prop.drafter.propose = capped(prop.drafter.propose, b)
    else:
        a = int(re.fullmatch(r"ngram(\d+)", v)[1])
        llm = LLM(**base, speculative_config=dict(method="ngram", num_speculative_tokens=a, adaptive=False))
    engines[v] = llm
prompts, source = _prompts(engines["plain"].get_tokenizer(), workload, 8, "sharegpt")
params = SamplingParams(temperature=0, max_tokens=96)
speed = {n: [] for n in engines}
outs = {}
for rnd in range(rounds):
    for name, llm in engines.items():
        t, tokens, got = time.perf_counter(), 0, []
        for p in prompts:
            o = llm.generate([p], params, use_tqdm=False)[0].outputs[0]
            tokens += len(o.token_ids)
            got.append(o.token_ids)
        speed[name].append(tokens / (time.perf_counter() - t))
        outs[name] = got
    assert all(o == outs["plain"] for o in outs.values()), "outputs differ"
    print(f"round {rnd}: " + "  ".join(f"{n} {v[-1]:.1f}" for n, v in speed.items()), flush=True)
ratios = {n: statistics.median(a / b for a, b in zip(v, speed["plain"])) for n, v in speed.items()}
print(f"{workload} ({source}) T=0 b=1: " + "  ".join(
    f"{n} {statistics.median(speed[n]):.1f} tok/s ({ratios[n]:.3f}x)" for n in speed))
