"""Where a batch-1 verify step's time goes, chain against tree (SmolLM2 fp32, the trained
EAGLE-3 served in int8, k = 1 or 3): median ms per step of the forward, the head, the
verification (sampling + rejection), drafting, and the whole engine step.
usage: python tree_step_parts.py DRAFTER_DIR TEMPERATURE K TREE|chain"""
import collections, statistics, sys, time
from tokenmill import LLM, SamplingParams

drafter, temp, k, tree = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
spec = dict(method="eagle3", model=drafter, quantization="int8", num_speculative_tokens=k, adaptive=False)
if tree != "chain":
    spec["speculative_token_tree"] = tree
llm = LLM(model="smollm2-135m", num_threads=2, max_model_len=2048, max_num_seqs=1, speculative_config=spec)
eng, runner = llm.engine, llm.engine.runner
acc = collections.defaultdict(float)


def timed(key, f):
    def g(*a, **kw):
        t = time.perf_counter()
        r = f(*a, **kw)
        acc[key] += time.perf_counter() - t
        return r
    return g


runner._forward = timed("forward", runner._forward)
runner.model.compute_logits = timed("head", runner.model.compute_logits)
runner._verify = timed("verify", runner._verify)
runner.spec._timed_propose = timed("draft", runner.spec._timed_propose)
rows, step0 = [], eng.step


def step():
    acc.clear()
    t = time.perf_counter()
    r = step0()
    acc["step"] = time.perf_counter() - t
    rows.append(dict(acc))
    return r


eng.step = step
prompt = ("<|im_start|>user\nWrite a short story about a lighthouse keeper who finds a message in a "
          "bottle.<|im_end|>\n<|im_start|>assistant\n")
for rep in range(3):
    rows.clear()
    llm.generate([prompt], SamplingParams(temperature=temp, seed=rep, max_tokens=128, ignore_eos=True), use_tqdm=False)
    verify = [r for r in rows[2:] if "verify" in r]
    s = llm.get_stats()
    print(f"{tree} k={k} T={temp}: steps {len(rows)}  " + "  ".join(
        f"{key} {1000 * statistics.median(r.get(key, 0) for r in verify):.2f}" for key in
        ("forward", "head", "verify", "draft", "step")), flush=True)
