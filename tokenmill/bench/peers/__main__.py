"""One engine's measurement, run in its own process by `tokenmill bench compare`:

    python -m tokenmill.bench.peers SPEC.json RESULT.json

SPEC holds the engine, its precision, the model and the workload (token-id prompts), so every
engine is timed on exactly the same tokens by this one routine. RESULT gets the medians, every
run's value, the greedy tokens of the throughput run (for output agreement), the load average
and the peak RSS of this process and every process it started that is still alive when the
measurement ends (an engine that computes in a child, as vLLM's engine core does, is counted
whole: tokenmill.bench.proc_memory). Only the standard library is imported here; the adapter
brings what its engine needs.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback


def _load_avg() -> float:
    return round(os.getloadavg()[0], 2)


def peak_rss_bytes() -> tuple[int, int]:
    """(peak RSS of this process plus its live descendants, how many of them counted)."""
    from tokenmill.bench.proc_memory import tree_peak_rss
    total, children = tree_peak_rss(os.getpid())
    if total:
        return total, children
    import resource   # not Linux: the best there is, this process alone
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale, 0


def _bar(total: int, desc: str, enabled: bool):
    from tokenmill.bench.report import progress
    return progress(total, desc, enabled)


def measure(engine, spec: dict) -> dict:
    """Batch-1 decode and prefill (medians of ``repeats`` after a warm-up), then offline
    throughput of every prompt in parallel sequences (median of ``throughput_repeats``)."""
    out_len, repeats = spec["output_len"], spec["repeats"]
    t_repeats = spec.get("throughput_repeats", repeats)
    decode_prompts, prefill_prompts, prompts = (spec["decode_prompts"], spec["prefill_prompts"],
                                                spec["prompts"])
    bar = _bar(2 + 2 * repeats + t_repeats, f"{spec['engine']} {spec['precision']}",
               spec.get("progress", True))
    engine.single(decode_prompts[0][:16], 4)                       # warm-up
    engine.batch([p[:16] for p in prompts[:2]], 4)
    bar.update(2)
    decode, prefill = [], []
    for r in range(repeats):
        tokens, first, total = engine.single(decode_prompts[r % len(decode_prompts)], out_len)
        decode.append((len(tokens) - 1) / (total - first))
        bar.update()
    for r in range(repeats):
        prompt = prefill_prompts[r % len(prefill_prompts)]
        _, first, _ = engine.single(prompt, 1)
        prefill.append(len(prompt) / first)
        bar.update()
    throughput, total_rate, outputs = [], [], None
    num_prompt_tokens = sum(len(p) for p in prompts)
    for _ in range(t_repeats):
        t = time.perf_counter()
        outputs = engine.batch(prompts, out_len)
        elapsed = time.perf_counter() - t
        num_out = sum(len(o) for o in outputs)
        throughput.append(num_out / elapsed)
        total_rate.append((num_prompt_tokens + num_out) / elapsed)
        bar.update()
    bar.close()
    return {"decode_tok_s": round(statistics.median(decode), 2),
            "prefill_tok_s": round(statistics.median(prefill), 2),
            "throughput_tok_s": round(statistics.median(throughput), 2),
            "throughput_total_tok_s": round(statistics.median(total_rate), 2),
            "runs": {"decode_tok_s": [round(v, 2) for v in decode],
                     "prefill_tok_s": [round(v, 2) for v in prefill],
                     "throughput_tok_s": [round(v, 2) for v in throughput]},
            "output_token_ids": outputs}


def measure_contexts(engine, spec: dict) -> dict:
    """Prefill and batch-1 decode at each context (medians of ``repeats``), for
    `bench compare --contexts` (compare_contexts.py)."""
    out_len, repeats = spec["context_output_len"], spec["repeats"]
    bar = _bar(1 + repeats * len(spec["contexts"]), f"{spec['engine']} {spec['precision']} contexts",
               spec.get("progress", True))
    engine.single(spec["context_prompts"][str(spec["contexts"][0])][:16], 4)   # warm-up
    bar.update()
    results = {}
    for c in spec["contexts"]:
        prompt, decode, prefill = spec["context_prompts"][str(c)], [], []
        for _ in range(repeats):
            tokens, first, total = engine.single(prompt, out_len)
            prefill.append(len(prompt) / first)
            decode.append((len(tokens) - 1) / (total - first))
            bar.update()
        results[str(c)] = {"prefill_tok_s": round(statistics.median(prefill), 2),
                           "decode_tok_s": round(statistics.median(decode), 2)}
    bar.close()
    return {"contexts": results}


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    result: dict = {"engine": spec["engine"], "precision": spec["precision"],
                    "load_avg_1m_before": _load_avg()}
    try:
        from tokenmill.bench.peers import load_adapter
        t = time.perf_counter()
        engine = load_adapter(spec["engine"], spec)
        result["load_s"] = round(time.perf_counter() - t, 2)
        result.update(engine.info)
        result.update(measure_contexts(engine, spec) if spec.get("contexts") else measure(engine, spec))
        result["status"] = "ok"
    except Exception as e:   # reported in the table, never fatal for the other engines
        result["status"] = f"error: {type(e).__name__}: {e}"[:300]
        result["traceback"] = traceback.format_exc()[-3000:]
    result["load_avg_1m_after"] = _load_avg()
    result["peak_rss_bytes"], result["peak_rss_children"] = peak_rss_bytes()   # engine still up
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
