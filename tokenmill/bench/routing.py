"""`tokenmill bench routing`: prefix-aware vs round-robin routing over data-parallel replicas.

Workload: multi-turn conversations (ShareGPT, or random tokens with ``--random-prompts``)
behind one shared system prompt, played in rounds: each round every conversation sends its
next turn (the whole history so far, the model's own answers included) at the same moment, so
the replicas are busy together; the order changes from round to round. Each router gets a fresh engine built from the same flags and
the same workload. Reported per router: the prefix-cache hit rate (the replicas'
``prefix_cache_hits / prefix_cache_queries``, warm-up excluded) of the run and of turns >= 2
(the turns routing decides: a first turn shares only the system prompt), TTFT p50 / p99 as
the caller sees it (add to first token), the same for turns >= 2, wall time and requests
per replica.
"""
from __future__ import annotations

import random
import time

from tokenmill.bench.common import emit, machine_info
from tokenmill.bench.report import Chart, add_output_args, progress
from tokenmill.bench.workloads import SYSTEM_PROMPT, random_ids

ROUTERS = ("round_robin", "prefix")


def add_parser(sub) -> None:
    p = sub.add_parser("routing", help="data parallelism: prefix-aware vs round-robin routing")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data-parallel-size", type=int, default=2)
    p.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default="mp")
    p.add_argument("--num-conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-message-chars", type=int, default=300)
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--random-prompts", action="store_true",
                   help="random-token conversations (no tokenizer or ShareGPT needed)")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads per replica")
    p.add_argument("--json", default=None)
    add_output_args(p)
    p.set_defaults(func=run)


class ShareGPTChats:
    """ShareGPT conversations: user turns from the data set, answers from the model."""

    def __init__(self, tokenizer, num: int, turns: int, max_chars: int) -> None:
        from tokenmill.data.sharegpt import conversations
        convs = [c for c in conversations("benchmark", limit=30 * num)
                 if len(c) >= 2 * turns - 1][:num]
        if len(convs) < num:
            raise ValueError(f"only {len(convs)} ShareGPT conversations have {turns} turns")
        self.tokenizer, self.max_chars = tokenizer, max_chars
        self._users = [[c[2 * t]["content"][:max_chars] for t in range(turns)] for c in convs]
        self._history = [[{"role": "system", "content": SYSTEM_PROMPT}] for _ in convs]

    def prompt(self, conv: int, turn: int) -> list[int]:
        self._history[conv].append({"role": "user", "content": self._users[conv][turn]})
        return list(self.tokenizer.apply_chat_template(self._history[conv],
                                                       add_generation_prompt=True, tokenize=True))

    def answer(self, conv: int, completion) -> None:
        self._history[conv].append({"role": "assistant", "content": completion.text})


class RandomChats:
    """The same shape in random tokens: a shared 256-token system prompt, 32-96-token user
    turns, the model's answer tokens kept in the history."""

    def __init__(self, vocab: int, num: int, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        system = random_ids(self._rng, 256, vocab)
        self.vocab = vocab
        self._history = [list(system) for _ in range(num)]

    def prompt(self, conv: int, turn: int) -> list[int]:
        self._history[conv] += random_ids(self._rng, self._rng.randint(32, 96), self.vocab)
        return list(self._history[conv])

    def answer(self, conv: int, completion) -> None:
        self._history[conv] += completion.token_ids


def _percentile_ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(1000.0 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


def _play_round(engine, prompts: dict, params) -> tuple[dict, dict]:
    """Send every prompt at once; (request id -> TTFT seconds, request id -> final output)."""
    sent, ttft, final = {}, {}, {}
    for request_id, ids in prompts.items():
        sent[request_id] = time.perf_counter()
        engine.add_request(request_id, {"prompt_token_ids": ids}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id not in ttft and out.outputs[0].token_ids:
                ttft[out.request_id] = time.perf_counter() - sent[out.request_id]
            if out.finished:
                final[out.request_id] = out
    return ttft, final


def _run_router(args, router: str, bar) -> dict:
    from tokenmill import LLM, SamplingParams
    llm = LLM(model=args.model, data_parallel_size=args.data_parallel_size, router=router,
              distributed_executor_backend=args.distributed_executor_backend,
              num_threads=args.num_threads, skip_tokenizer_init=args.random_prompts,
              max_model_len=None if args.random_prompts else 4096, max_num_batched_tokens=4096)
    engine = llm.engine
    try:
        chats = (RandomChats(engine.vocab_size, args.num_conversations)
                 if args.random_prompts else
                 ShareGPTChats(llm.get_tokenizer(), args.num_conversations, args.turns,
                               args.max_message_chars))
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        before, t0 = engine.get_stats(), time.perf_counter()
        ttfts: list[tuple[int, float]] = []
        arrivals = random.Random(0)   # the same order for every router
        for turn in range(args.turns):
            # a new order each round, as clients answer at their own pace (a fixed order
            # would let round robin keep every conversation on one replica by accident)
            order = arrivals.sample(range(args.num_conversations), args.num_conversations)
            prompts = {f"c{c}-t{turn}": chats.prompt(c, turn) for c in order}
            ttft, final = _play_round(engine, prompts, params)
            for c in range(args.num_conversations):
                chats.answer(c, final[f"c{c}-t{turn}"].outputs[0])
            ttfts += [(turn, ttft[r]) for r in prompts]
            if turn == 0:
                first_round = engine.get_stats()
            bar.update()
        wall = time.perf_counter() - t0
        after = engine.get_stats()
    finally:
        if hasattr(engine, "shutdown"):
            engine.shutdown()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    # turns >= 2: what routing decides (turn 1 only shares the system prompt)
    later_queries = after["prefix_cache_queries"] - first_round["prefix_cache_queries"]
    later_hits = after["prefix_cache_hits"] - first_round["prefix_cache_hits"]
    later = [t for turn, t in ttfts if turn >= 1] or [t for _, t in ttfts]
    replicas = after.get("replicas", [after])
    return {"router": router, "prefix_hit_rate": round(hits / queries, 4) if queries else 0.0,
            "prefix_hit_rate_turns_ge_2": (round(later_hits / later_queries, 4)
                                           if later_queries else 0.0),
            "ttft_p50_ms": _percentile_ms([t for _, t in ttfts], 0.50),
            "ttft_p99_ms": _percentile_ms([t for _, t in ttfts], 0.99),
            "ttft_p50_ms_turns_ge_2": _percentile_ms(later, 0.50),
            "ttft_p99_ms_turns_ge_2": _percentile_ms(later, 0.99),
            "wall_s": round(wall, 2),
            "requests_per_replica": [r["num_requests"] - b["num_requests"]
                                     for r, b in zip(replicas, before.get("replicas", [before]))]}


def run(args) -> int:
    if args.num_conversations < 1 or args.turns < 1:
        raise ValueError("--num-conversations and --turns must be at least 1")
    bar = progress(len(ROUTERS) * args.turns, "bench routing", args.progress)
    rows = [_run_router(args, router, bar) for router in ROUTERS]
    bar.close()
    rr, prefix = rows
    result = {"bench": "routing", "model": args.model,
              "data_parallel_size": args.data_parallel_size,
              "backend": args.distributed_executor_backend,
              "workload": "random tokens" if args.random_prompts else "ShareGPT + system prompt",
              "num_conversations": args.num_conversations, "turns": args.turns,
              "output_len": args.output_len, "machine": machine_info(), "rows": rows,
              "hit_rate_gain": round(prefix["prefix_hit_rate"] - rr["prefix_hit_rate"], 4),
              "hit_rate_gain_turns_ge_2": round(prefix["prefix_hit_rate_turns_ge_2"]
                                                - rr["prefix_hit_rate_turns_ge_2"], 4),
              "ttft_p50_speedup": (round(rr["ttft_p50_ms"] / prefix["ttft_p50_ms"], 2)
                                   if prefix["ttft_p50_ms"] else None)}
    emit(result, args.json, args.output_dir, rows=rows,
         chart=Chart("router", ("prefix_hit_rate_turns_ge_2", "ttft_p50_ms_turns_ge_2",
                               "ttft_p99_ms_turns_ge_2"),
                     title=f"routing over {args.data_parallel_size} replicas, {args.model}"))
    return 0
