"""`tokenmill bench prefix`: a multi-turn ShareGPT workload where every turn resends the
conversation so far. Reports the prefix-cache hit rate against the theoretical maximum and
the p50 TTFT of turns >= 2 with the cache on vs off, in the same run and engine."""
from __future__ import annotations

import statistics
import time

from tokenmill.bench.common import emit, machine_info
from tokenmill.bench.report import Chart, add_output_args, progress


def add_parser(sub) -> None:
    p = sub.add_parser("prefix", help="prefix caching on a multi-turn ShareGPT workload")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-message-chars", type=int, default=400)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json", default=None)
    add_output_args(p)
    p.set_defaults(func=run)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _run_conversation(llm, conv, turns: int, max_chars: int, params) -> list[dict]:
    """Play one conversation turn by turn, alone on the engine (so TTFT is the prefill, not
    queueing): each turn resends the history, with the model's own earlier answers."""
    tokenizer, engine = llm.get_tokenizer(), llm.engine
    history, rows = [], []
    prev_tokens: list[int] = []
    for t in range(turns):
        history.append({"role": "user", "content": conv[2 * t]["content"][:max_chars]})
        ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        completion = out.outputs[0]
        rows.append({"turn": t, "prompt_len": len(ids), "ttft_s": engine.stats.ttfts.recent[-1],
                     "cached": out.num_cached_tokens,
                     "max_cacheable": min(_common_prefix(prev_tokens, ids), len(ids) - 1)})
        prev_tokens = ids + completion.token_ids
        history.append({"role": "assistant", "content": completion.text})
    return rows


def _run_all(llm, convs, args, params, bar) -> dict:
    t0 = time.perf_counter()
    rows = []
    for conv in convs:
        rows += _run_conversation(llm, conv, args.turns, args.max_message_chars, params)
        bar.update()
    later = [r for r in rows if r["turn"] >= 1]
    block = llm.engine.scheduler.kv.block_size
    queried = sum(r["prompt_len"] for r in later)
    return {"p50_ttft_ms_turns_ge_2": round(1000 * statistics.median(r["ttft_s"] for r in later), 1),
            "p50_ttft_ms_turn_1": round(1000 * statistics.median(r["ttft_s"] for r in rows if r["turn"] == 0), 1),
            "hit_rate_turns_ge_2": round(sum(r["cached"] for r in later) / queried, 4),
            "theoretical_max_hit_rate": round(
                sum((r["max_cacheable"] // block) * block for r in later) / queried, 4),
            "wall_s": round(time.perf_counter() - t0, 2)}


def _set_caching(llm, enabled: bool) -> None:
    llm.engine.scheduler.kv.set_caching(enabled)


def run(args) -> int:
    from tokenmill import LLM, SamplingParams
    from tokenmill.data.sharegpt import conversations
    convs = [c for c in conversations("benchmark", limit=20 * args.num_conversations)
             if len(c) >= 2 * args.turns - 1][:args.num_conversations]
    llm = LLM(model=args.model, num_threads=args.num_threads, max_model_len=8192,
              max_num_batched_tokens=8192)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    results = {}
    modes = ("off", "on", "off_again")   # off twice: drift in machine load shows up
    bar = progress(len(modes) * len(convs), "bench prefix", args.progress)
    for mode in modes:
        _set_caching(llm, mode == "on")
        results[mode] = _run_all(llm, convs, args, params, bar)
    bar.close()
    off = statistics.median([results["off"]["p50_ttft_ms_turns_ge_2"],
                             results["off_again"]["p50_ttft_ms_turns_ge_2"]])
    emit({"bench": "prefix", "model": args.model, "num_conversations": len(convs),
          "turns": args.turns, "output_len": args.output_len, "machine": machine_info(),
          "cache_off": results["off"], "cache_on": results["on"],
          "cache_off_again": results["off_again"],
          "ttft_speedup_turns_ge_2": round(off / results["on"]["p50_ttft_ms_turns_ge_2"], 2)},
         args.json, args.output_dir,
         rows=[{"prefix_cache": mode.replace("_", " "), **results[mode]} for mode in modes],
         chart=Chart("prefix_cache", ("p50_ttft_ms_turns_ge_2", "hit_rate_turns_ge_2", "wall_s"),
                     title=f"prefix caching, {args.model}"))
    return 0
