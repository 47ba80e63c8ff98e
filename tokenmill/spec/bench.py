"""`tokenmill bench spec`: speculative decoding speed against no speculation, measured in one
run on one engine (the same weights and KV pool; the drafter is swapped between runs).

For each workload x temperature x batch size, no speculation and every requested method run
interleaved (none, m1, m2, ..., none, m1, ...) for ``--repeats`` rounds after a warm-up round,
so a change of machine load hits all of them alike; the load average is printed beside each
row. Batch B runs max(B, --min-prompts) prompts with at most B at a time.

Workloads: *grounded* (repeat / rewrite / answer a question from a given ShareGPT text: the
output copies the input, which n-gram lookup exploits) and *chat* (ShareGPT opening user
turns, open-ended). ``--prompt-source builtin`` uses small built-in sets instead (offline).

Per row: output tok/s (median over rounds; prompts are prefix-cached after the warm-up, so
this is nearly all decoding), ratio over no speculation (median of per-round ratios), mean
acceptance length tau (tokens per target forward for a drafted request, bonus included),
acceptance rate, per-position acceptance (accepted at position j / drafts), the engine's own
estimated speedup (tokenmill.spec.metrics) for comparison with the measured ratio, the k the
adaptive controller chose, the share of outputs identical to no speculation (greedy at
temperature 0; per-request seeds at temperature > 0, where speculation is exact too), and for
ngram_<method> rows the share of drafted-for requests that prompt lookup served and how many
steps the adaptive controller ran prompt lookup without the drafter (lookup_only_steps).
"""
from __future__ import annotations

import dataclasses
import functools
import statistics
import sys
import time
from typing import Optional

from tokenmill.bench.common import emit, machine_info
from tokenmill.bench.report import Chart, add_output_args, progress

TEXTS = [
    "The river town of Millbrook holds a market every Saturday. Farmers bring apples, honey and "
    "fresh bread, and the baker sells out of rye loaves before noon. In winter the market moves "
    "into the old grain hall, where a brass band plays on the first Saturday of each month.",
    "To reset the router, hold the small button on the back for ten seconds until the light "
    "turns orange. Wait two minutes for the light to turn green, then connect to the network "
    "named HOME-SETUP and open the address printed on the label to choose a new password.",
    "Ada Lovelace wrote the first published algorithm intended for a machine, a method for "
    "computing Bernoulli numbers on Charles Babbage's proposed Analytical Engine. She also "
    "argued that such a machine could act on symbols other than numbers, such as musical notes.",
    "The committee met on Tuesday and agreed on three points: the library will open at eight "
    "instead of nine, the reading room will stay quiet after six, and a new shelf for local "
    "history books will be built next to the main entrance before the end of the year.",
]
CHAT = [
    "Tell me a short story about a dragon who learns to cook.", "What makes a good friend?",
    "Give me three ideas for a rainy weekend.", "Why is the sky blue? Explain simply.",
    "Write a haiku about autumn.", "What should I pack for a beach trip?",
    "Describe your ideal breakfast.", "How do plants grow?", "Suggest a name for a cat.",
    "What is your favorite season and why?", "Explain what a computer does.",
    "Write a limerick about a frog.", "How can I sleep better?", "What is the moon made of?",
    "Tell me a fun fact about octopuses.", "Plan a small birthday party for a child.",
]
# Text first, then the instruction: the form SmolLM2-135M copies most faithfully.
GROUNDED_TASKS = {
    "repeat": "Here is a text:\n\n{text}\n\nWrite the text again, exactly as it is.",
    "rewrite": "Here is a text:\n\n{text}\n\nRewrite the text above, keeping every sentence.",
    "answer": "Here is a text:\n\n{text}\n\nUsing only the text above, answer: {question}",
}
METHODS = ("ngram", "layer_skip", "draft_model", "medusa", "eagle3", "dflash")
TRAINED = ("draft_model", "medusa", "eagle3", "dflash")   # need a checkpoint (--drafter)


def add_parser(sub) -> None:
    p = sub.add_parser("spec", help="speculative decoding speedup vs none (ngram, layer_skip, "
                                    "draft_model, medusa, eagle3, dflash; adaptive_<method> for "
                                    "adaptive k, <method>_int8 for an int8-served eagle3 / dflash)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--min-prompts", type=int, default=4,
                   help="prompts per run at least (batch 1 runs them one at a time)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--methods", "--configs", dest="methods",
                   default="ngram,adaptive_ngram,layer_skip,adaptive_layer_skip",
                   help=f"comma list of {', '.join(METHODS)}, each optionally adaptive_<method>; "
                        "eagle3_int8 / dflash_int8: the drafter served in int8; ngram_<method>: "
                        "prompt lookup where it finds a match, the method's drafter elsewhere; "
                        "<eagle3 method>_tree: draft trees (--token-tree)")
    p.add_argument("--token-tree", default="[(0,), (1,), (2,)]",
                   help="speculative_token_tree of the _tree methods (vLLM's spelling: paths of "
                        "child ranks; alternatives are leaves). The default, three candidates at "
                        "the first position, measured best on SmolLM2 at batch 1")
    p.add_argument("--layer-skip-layers", type=int, default=8)
    p.add_argument("--draft-model", default=None, help="checkpoint for draft_model")
    p.add_argument("--drafter", action="append", default=[], metavar="METHOD=DIR",
                   help="trained drafter for medusa / eagle3 / dflash / draft_model (the output "
                        "of tokenmill train-drafter; its train_summary.json gives the training "
                        "time in the rows), repeatable")
    p.add_argument("--workloads", default="grounded,chat")
    p.add_argument("--temperature", default="0",
                   help="comma list of temperatures; 0 is always measured (e.g. --temperature 1)")
    p.add_argument("--prompt-source", choices=["sharegpt", "builtin"], default="sharegpt")
    p.add_argument("--kv-cache-memory", type=int, default=1024, help="MiB")
    p.add_argument("--quantization", default=None,
                   help="the target's weights, e.g. gguf (GGUF blocks kept packed)")
    p.add_argument("--quant-activations", default="fp32", choices=["fp32", "q8"],
                   help="q8: int8-rounded activations for packed weights (gguf + q8 = gguf-q8)")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json", default=None, help="also write the result to this file")
    add_output_args(p)
    p.set_defaults(func=run)


def _drafter_dirs(items: list[str]) -> dict:
    out = {}
    for item in items:
        method, sep, path = item.partition("=")
        if not sep or method not in TRAINED:
            raise ValueError(f"--drafter wants METHOD=DIR with METHOD one of {TRAINED}, got {item!r}")
        out[method] = path
    return out


def training_facts(path) -> dict:
    """Training time and held-out tau from a train-drafter output directory, if it has them."""
    import json
    import os
    summary = os.path.join(path or "", "train_summary.json")
    if not path or not os.path.isfile(summary):
        return {}
    with open(summary) as f:
        s = json.load(f)
    # the data's build time, recorded in the cache by the run that built it (a rerun's own
    # data_seconds is only a cache read); older summaries have only data_seconds
    built = s.get("data_build_seconds")
    return {"train_seconds": s.get("train_seconds"),
            "data_seconds": built if built is not None else s.get("data_seconds"),
            "heldout_tau": s.get("heldout_tau")}


def _configs(names: list[str], args) -> dict:
    from tokenmill.config import SpeculativeConfig
    drafters = _drafter_dirs(args.drafter)
    out = {}
    for name in names:
        method = name.removeprefix("adaptive_")
        tree = method.endswith("_tree")
        method = method.removesuffix("_tree")
        ngram_first = method.startswith("ngram_")
        method = method.removeprefix("ngram_")
        quantization = None
        if method in ("eagle3_int8", "dflash_int8"):
            method, quantization = method.removesuffix("_int8"), "int8"
        if method not in METHODS or (ngram_first and method == "ngram"):
            raise ValueError(f"unknown method {name!r}; choose from {METHODS} (or adaptive_<method>, "
                             "ngram_<method>, eagle3_int8, dflash_int8, <eagle3 method>_tree)")
        lookup = dict(prompt_lookup_min=2, prompt_lookup_max=4)
        extra = {"ngram": lookup, "layer_skip": dict(num_layers=args.layer_skip_layers)}.get(method, {})
        if method in TRAINED:
            path = drafters.get(method) or (args.draft_model if method == "draft_model" else None)
            if not path:
                raise ValueError(f"method {name!r} needs a trained drafter: --drafter {method}=DIR")
            extra = dict(model=path, quantization=quantization)
        if ngram_first:
            extra = dict(extra, ngram_first=True, **lookup)
        if tree:
            extra = dict(extra, speculative_token_tree=args.token_tree)
        out[name] = SpeculativeConfig(method=method, num_speculative_tokens=args.k,
                                      adaptive=name.startswith("adaptive_"), **extra)
    return out


# -- prompts --------------------------------------------------------------------------------------
def _plain(text: str, lo: int, hi: int) -> bool:
    return lo <= len(text) <= hi and "```" not in text and \
        sum(c.isascii() for c in text) >= 0.98 * len(text)


_OPENERS = {"write", "explain", "tell", "give", "describe", "how", "what", "why", "can", "could",
            "create", "suggest", "list", "summarize", "compare", "help", "plan", "generate"}


def _is_request(question: str) -> bool:
    """A self-contained opening turn (ShareGPT also holds mid-conversation fragments)."""
    words = question.split()
    return bool(words) and (question.endswith("?") or words[0].lower().strip(",.:") in _OPENERS)


@functools.lru_cache(maxsize=1)
def _sharegpt_pool(size: int = 64) -> dict:
    """One pass over ShareGPT's benchmark split (deterministic, file order): up to ``size``
    grounded prompts (an assistant answer as the given text; repeat / rewrite / answer its
    original question, in turn) and ``size`` chat prompts (short opening user requests)."""
    from tokenmill.data.sharegpt import conversations
    pool = {"grounded": [], "chat": []}
    tasks = list(GROUNDED_TASKS.values())
    for conv in conversations("benchmark"):
        question, answer = conv[0]["content"].strip(), conv[1]["content"].strip()
        chat, grounded = pool["chat"], pool["grounded"]
        if len(chat) < size and _plain(question, 20, 300) and _is_request(question):
            chat.append(question)
        if len(grounded) < size and _plain(answer, 300, 900) and _plain(question, 10, 300):
            grounded.append(tasks[len(grounded) % len(tasks)].format(text=answer, question=question))
        if len(chat) == len(grounded) == size:
            break
    return pool


def sharegpt_messages(workload: str, num: int) -> list[str]:
    pool = _sharegpt_pool()[workload]
    return [pool[i % len(pool)] for i in range(num)] if pool else []


def builtin_messages(workload: str, num: int) -> list[str]:
    if workload == "grounded":
        texts = [t.format(text=x, question="What is the text about?")
                 for x in TEXTS for t in GROUNDED_TASKS.values()]
    else:
        texts = CHAT
    return [texts[i % len(texts)] for i in range(num)]


def _prompts(tokenizer, workload: str, num: int, source: str) -> tuple[list[dict], str]:
    texts = []
    if source == "sharegpt":
        try:
            texts = sharegpt_messages(workload, num)
        except Exception as e:     # no network and no cache: say so, measure anyway
            print(f"tokenmill bench spec: ShareGPT unavailable ({e}); using built-in prompts",
                  file=sys.stderr)
            source = "builtin"
    if len(texts) < num:
        texts, source = builtin_messages(workload, num), "builtin"
    prompts = [{"prompt_token_ids": tokenizer.apply_chat_template(
        [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)} for t in texts]
    return prompts, source


# -- measuring ------------------------------------------------------------------------------------
def _use(engine, decoder) -> None:
    """Swap the drafter (None = no speculation); only between runs, when nothing is queued."""
    engine.runner.spec = decoder
    engine.scheduler.num_lookahead_tokens = decoder.num_lookahead_tokens if decoder else 0


def _generate(llm, prompts, params) -> tuple[float, list[tuple[int, ...]]]:
    """(output tok/s, output token ids per prompt)."""
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    tokens = [tuple(o.outputs[0].token_ids) for o in outs]
    return sum(map(len, tokens)) / seconds, tokens


def _row_stats(dec, rounds: list[float], ratios: list[float], same: float) -> dict:
    s = dec.stats
    per_pos = [round(a / s.num_drafts, 3) if s.num_drafts else 0.0 for a in s.accepted_per_position]
    return {"tok_s": round(statistics.median(rounds), 2), "ratio": round(statistics.median(ratios), 3),
            "tau": round(s.mean_acceptance_length, 3), "acceptance_rate": round(s.acceptance_rate, 3),
            "accepted_per_position": per_pos, "est_speedup": round(s.estimated_speedup, 3),
            "identical": round(same, 3),
            "k_chosen": " ".join(f"{k}:{n}" for k, n in sorted(s.k_chosen.items())),
            "lookup_share": _lookup_share(dec.proposer),
            "lookup_only_steps": s.cheaper_mode_steps if hasattr(dec.proposer, "modes") else None,
            "tree_steps": s.tree_steps if dec.widths else None}


def _lookup_share(proposer) -> Optional[float]:
    """ngram_<method>: the share of drafted-for requests prompt lookup served (None otherwise)."""
    by = getattr(proposer, "drafts_by", None)
    total = sum(by.values()) if by else 0
    return round(by["lookup"] / total, 3) if total else None


def _salted(prompts: list[dict], dec, name: str) -> list[dict]:
    """A drafter that keeps its own context cache (EAGLE-3, DFlash) writes it while the target
    computes the prompt; prompt blocks cached by another method's run would leave it empty.
    Its runs get their own prefix-cache entries (a cache salt), warmed up by its own round 0."""
    if dec is None or not dec.proposer.aux_layers:
        return prompts
    return [dict(p, cache_salt=f"bench-spec-{name}") for p in prompts]


def _measure(llm, decoders: dict, prompts, params, args, bar) -> dict:
    """Interleaved rounds; returns method -> row fields."""
    engine = llm.engine
    rates = {name: [] for name in decoders}
    outputs = {}
    for rep in range(args.repeats + 1):            # round 0 is the warm-up
        for name, dec in decoders.items():
            _use(engine, dec)
            rate, tokens = _generate(llm, _salted(prompts, dec, name), params)
            bar.update()
            if rep == 0:
                outputs[name] = tokens
                if dec is not None:
                    dec.reset_stats()              # counters cover the timed rounds only
            else:
                rates[name].append(rate)
    _use(engine, None)
    rows = {"none": {"tok_s": round(statistics.median(rates["none"]), 2), "ratio": 1.0}}
    for name, dec in decoders.items():
        if dec is not None:
            ratios = [r / b for r, b in zip(rates[name], rates["none"])]
            same = sum(a == b for a, b in zip(outputs[name], outputs["none"])) / len(prompts)
            rows[name] = _row_stats(dec, rates[name], ratios, same)
    return rows


def run(args) -> int:
    from tokenmill import LLM, SamplingParams
    from tokenmill.spec.decoder import build_spec_decoder
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    temps = sorted({0.0} | {float(t) for t in args.temperature.split(",") if t.strip()})
    workloads = args.workloads.split(",")
    configs = _configs(args.methods.split(","), args)
    # drafters are attached to this engine after it is built, and some (layer_skip) read the
    # target's caches through group 0's table: one table over every layer
    llm = LLM(model=args.model, num_threads=args.num_threads, max_num_seqs=max(sizes),
              kv_cache_memory=args.kv_cache_memory * 1024**2, quantization=args.quantization,
              quant_activations=args.quant_activations, sliding_window_pools=False)
    engine = llm.engine
    full_sched = engine.scheduler.config
    result = {"bench": "spec", "model": args.model, "quantization": args.quantization,
              "quant_activations": args.quant_activations, "max_tokens": args.max_tokens, "k": args.k,
              "repeats": args.repeats, "methods": ",".join(configs), "machine_before": machine_info(),
              "rows": []}
    sources = set()
    total = len(workloads) * len(temps) * len(sizes) * (args.repeats + 1) * (len(configs) + 1)
    bar = progress(total, "bench spec", args.progress)
    for workload in workloads:
        for temp in temps:
            for batch in sizes:
                num = max(batch, args.min_prompts)
                prompts, source = _prompts(engine.tokenizer, workload, num, args.prompt_source)
                sources.add(source)
                params = [SamplingParams(temperature=temp, max_tokens=args.max_tokens, ignore_eos=True,
                                         seed=None if temp == 0 else 1000 + i) for i in range(num)]
                decoders = {"none": None}
                for name, cfg in configs.items():   # fresh counters and controllers per row
                    decoders[name] = build_spec_decoder(cfg, engine.runner, engine.max_model_len,
                                                        engine.scheduler.kv.num_total_blocks)
                engine.scheduler.config = dataclasses.replace(full_sched, max_num_seqs=batch)
                measured = _measure(llm, decoders, prompts, params, args, bar)
                engine.scheduler.config = full_sched
                load = machine_info()["load_avg_1m"]
                for method, fields in measured.items():
                    trained = training_facts(configs[method].model) if method in configs else {}
                    row = {"config": f"{workload} T={temp:g} b={batch} {method}", "workload": workload,
                           "temperature": temp, "batch": batch, "method": method, **fields,
                           **trained, "load_avg_1m": load}
                    print(row, file=sys.stderr, flush=True)
                    result["rows"].append(row)
    bar.close()
    result["prompt_source"] = ",".join(sorted(sources))
    result["machine_after"] = machine_info()
    emit(result, args.json, args.output_dir, name="spec",
         chart=Chart("config", ("ratio", "tau", "tok_s"), title=f"speculative decoding, {args.model}"))
    return 0
