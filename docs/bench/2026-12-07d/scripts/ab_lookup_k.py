"""Prompt lookup first with a longer lookup draft than the drafter's chain, fixed k, batch 1,
T = 0, in one process, interleaved: plain decoding; lookup then EAGLE-3 (int8), both k 3;
lookup up to L, EAGLE-3 still 3 (the drafter's count capped by wrapping its propose: what a
separate lookup length would do); n-gram alone at k 3 and at L. bench spec's chat or grounded
prompts (held-out ShareGPT), 8 of them one at a time, 96 tokens, R rounds, each engine once per
round; prints tok/s per round and the median ratio to plain. Outputs are checked equal.
usage: python ab_lookup_k.py EAGLE3_DIR L [chat|grounded] [rounds]"""
import statistics, sys, time
from tokenmill import LLM, SamplingParams
from tokenmill.spec.bench import _prompts

drafter, L = sys.argv[1], int(sys.argv[2])
workload = sys.argv[3] if len(sys.argv) > 3 else "chat"
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 4
base = dict(model="smollm2-135m", num_threads=2, max_model_len=2048, max_num_seqs=1)
eagle = dict(method="eagle3", model=drafter, quantization="int8", adaptive=False, ngram_first=True)
engines = {"plain": LLM(**base),
           "lookup3_eagle3": LLM(**base, speculative_config=dict(eagle, num_speculative_tokens=3)),
           f"lookup{L}_eagle3": LLM(**base, speculative_config=dict(eagle, num_speculative_tokens=L)),
           "ngram3": LLM(**base, speculative_config=dict(method="ngram", num_speculative_tokens=3, adaptive=False)),
           f"ngram{L}": LLM(**base, speculative_config=dict(method="ngram", num_speculative_tokens=L, adaptive=False))}
prop = engines[f"lookup{L}_eagle3"].engine.runner.spec.proposer
inner = prop.drafter.propose


def capped(inp):
    inp.num_drafts = [min(n, 3) for n in inp.num_drafts]
    return inner(inp)


prop.drafter.propose = capped
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
print(f"{workload} ({source}) T=0 b=1 L={L}: " + "  ".join(f"{n} {statistics.median(speed[n]):.1f} tok/s ({ratios[n]:.3f}x)" for n in speed))
