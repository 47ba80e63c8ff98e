"""Where a batch-1 step's time goes at T = 0 (SmolLM2 fp32, chat prompt): plain decoding
against the trained EAGLE-3 served in int8 with fixed k (chain, or a tree): median ms per step
of the target forward, the head, verification, drafting (the proposer: record + draft) and
the whole engine step, then cProfile's top entries inside the proposer.
usage: python step_parts.py DRAFTER_DIR K [TREE] [prompt lookup first: 0|1]"""
import cProfile, collections, pstats, statistics, sys, time
from tokenmill import LLM, SamplingParams

drafter, k = sys.argv[1], int(sys.argv[2])
tree = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "chain" else None
ngram_first = len(sys.argv) > 4 and sys.argv[4] == "1"
prompt = ("<|im_start|>user\nWrite a short story about a lighthouse keeper who finds a message in a "
          "bottle.<|im_end|>\n<|im_start|>assistant\n")


def run(spec):
    llm = LLM(model="smollm2-135m", num_threads=2, max_model_len=2048, max_num_seqs=1,
              speculative_config=spec)
    eng, runner = llm.engine, llm.engine.runner
    acc = collections.defaultdict(float)

    def timed(key, obj, name):
        f = getattr(obj, name)

        def g(*a, **kw):
            t = time.perf_counter()
            r = f(*a, **kw)
            acc[key] += time.perf_counter() - t
            return r
        setattr(obj, name, g)

    timed("forward", runner, "_forward")
    timed("head", runner.model, "compute_logits")
    if spec:
        timed("verify", runner, "_verify")
        timed("draft", runner.spec, "_timed_propose")
    rows, step0 = [], eng.step

    def step():
        acc.clear()
        t = time.perf_counter()
        r = step0()
        acc["step"] = time.perf_counter() - t
        rows.append(dict(acc))
        return r
    eng.step = step
    for rep in range(3):
        rows.clear()
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=192, ignore_eos=True),
                           use_tqdm=False)
        steady = rows[2:]
        name = "plain" if not spec else f"eagle3 k={k} {tree or 'chain'}{' ngram_first' if ngram_first else ''}"
        print(f"{name}: steps {len(rows)} tokens/step {192 / len(rows):.2f}  " + "  ".join(
            f"{key} {1000 * statistics.median(r.get(key, 0) for r in steady):.2f}" for key in
            ("forward", "head", "verify", "draft", "step")), flush=True)
    if spec:
        prof = cProfile.Profile()
        prop = runner.spec.proposer
        f = prop.propose

        def profiled(inp):
            prof.enable()
            try:
                return f(inp)
            finally:
                prof.disable()
        prop.propose = profiled
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=192, ignore_eos=True), use_tqdm=False)
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
        pstats.Stats(prof).sort_stats("cumtime").print_stats(45)
    return out[0].outputs[0].token_ids


spec = dict(method="eagle3", model=drafter, quantization="int8", num_speculative_tokens=k,
            adaptive=False, ngram_first=ngram_first)
if tree:
    spec["speculative_token_tree"] = tree
a = run(None)
b = run(spec)
print("identical:", list(a) == list(b))
