"""The interleaved timing loop of ab_dflash.py and ab_eagle3_t1.py: each engine once per round
over the prompts one at a time (batch 1), outputs checked equal to the "plain" engine's, then
the medians, the ratios to plain and each speculative engine's acceptance by position."""
import statistics, time


def run_rounds(engines: dict, prompts: list, params: list, rounds: int) -> dict:
    speed = {n: [] for n in engines}
    outs = {}
    for rnd in range(rounds):
        for name, llm in engines.items():
            t, tokens, got = time.perf_counter(), 0, []
            for p, sp in zip(prompts, params):
                o = llm.generate([p], sp, use_tqdm=False)[0].outputs[0]
                tokens += len(o.token_ids)
                got.append(o.token_ids)
            speed[name].append(tokens / (time.perf_counter() - t))
            outs[name] = got
        assert all(v == outs["plain"] for v in outs.values()), "outputs differ"
        print(f"round {rnd}: " + "  ".join(f"{n} {v[-1]:.1f}" for n, v in speed.items()), flush=True)
    return speed


def report(engines: dict, speed: dict, label: str) -> None:
    ratios = {n: statistics.median(a / b for a, b in zip(v, speed["plain"])) for n, v in speed.items()}
    print(f"{label}: " + "  ".join(f"{n} {statistics.median(speed[n]):.1f} tok/s ({ratios[n]:.3f}x)"
                                   for n in engines))
    for name, llm in engines.items():
        if name != "plain":
            s = llm.get_stats()
            n = max(s["spec_num_drafts"], 1)
            print(f"{name}: tau {s['spec_mean_acceptance_length']:.3f}  acceptance by position "
                  f"{[round(a / n, 3) for a in s['spec_accepted_per_position']]}  "
                  f"k chosen {s['spec_k_chosen']}")
