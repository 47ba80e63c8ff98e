"""`tokenmill bench spec`: speculative decoding speed against no speculation, measured in one
run on one engine (the same weights and KV pool; the drafter is swapped between runs), runs
interleaved ABAB..., medians of --repeats after a warm-up, with the load average printed.

Workloads: *grounded* (repeat / rewrite / answer from a given text: the output copies the
input, which n-gram lookup exploits) and *chat* (open-ended questions). Per configuration:
tokens/s ratio over no speculation, mean acceptance length tau (tokens per target forward for
a drafted request, bonus included) and per-position acceptance.
"""
from __future__ import annotations

import statistics
import time

from tokenmill.bench.common import emit, machine_info

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
TASKS = [   # text first, then the instruction: the form SmolLM2-135M copies most faithfully
    "Here is a text:\n\n{text}\n\nWrite the text again, exactly as it is.",
    "Here is a text:\n\n{text}\n\nCopy the text above word for word.",
    "Here is a text:\n\n{text}\n\nRewrite the text above, keeping every sentence.",
    "Here is a text:\n\n{text}\n\nRepeat the first two sentences of the text.",
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


def add_parser(sub) -> None:
    p = sub.add_parser("spec", help="speculative decoding speedup vs none (ngram, layer_skip, adaptive)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--layer-skip-layers", type=int, default=8)
    p.add_argument("--workloads", default="grounded,chat")
    p.add_argument("--configs", default="ngram,layer_skip,adaptive_ngram,adaptive_layer_skip")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)


def _configs(names: list[str], k: int, layers: int) -> dict:
    from tokenmill.config import SpeculativeConfig
    table = {
        "ngram": dict(method="ngram", prompt_lookup_min=2, prompt_lookup_max=4, adaptive=False),
        "layer_skip": dict(method="layer_skip", num_layers=layers, adaptive=False),
        "adaptive_ngram": dict(method="ngram", prompt_lookup_min=2, prompt_lookup_max=4),
        "adaptive_layer_skip": dict(method="layer_skip", num_layers=layers),
    }
    return {n: SpeculativeConfig(num_speculative_tokens=k, **table[n]) for n in names}


def _prompts(tokenizer, workload: str, num: int) -> list[dict]:
    if workload == "grounded":
        texts = [t.format(text=x) for x in TEXTS for t in TASKS]
    else:
        texts = CHAT
    texts = [texts[i % len(texts)] for i in range(num)]
    return [{"prompt_token_ids": tokenizer.apply_chat_template(
        [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)} for t in texts]


def _timed(llm, prompts, max_tokens: int) -> float:
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def _use(engine, decoder) -> None:
    """Swap the drafter (None = no speculation); only between runs, when nothing is queued."""
    engine.runner.spec = decoder
    engine.scheduler.num_lookahead_tokens = decoder.num_lookahead_tokens if decoder else 0


def _measure(llm, decoders: dict, prompts, args) -> dict:
    engine = llm.engine
    rates = {name: [] for name in decoders}
    for rep in range(args.repeats + 1):            # round 0 is the warm-up
        for name, dec in decoders.items():
            _use(engine, dec)
            rate = _timed(llm, prompts, args.max_tokens)
            if rep:
                rates[name].append(rate)
    _use(engine, None)
    base = statistics.median(rates["none"])
    row = {"none_tok_s": round(base, 2)}
    for name, dec in decoders.items():
        if name == "none":
            continue
        s = dec.stats
        row[name] = {"ratio": round(statistics.median(rates[name]) / base, 3),
                     "tok_s": round(statistics.median(rates[name]), 2),
                     "tau": round(s.mean_acceptance_length, 3),
                     "accepted_per_position": [round(a / s.num_drafts, 3) if s.num_drafts else 0.0
                                               for a in s.accepted_per_position],
                     "k_chosen": dict(sorted(s.k_chosen.items()))}
    return row


def run(args) -> int:
    from tokenmill import LLM
    from tokenmill.spec.decoder import build_spec_decoder
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    llm = LLM(model=args.model, num_threads=args.num_threads, max_num_seqs=max(sizes),
              kv_cache_memory=768 * 1024**2)
    engine = llm.engine
    result = {"bench": "spec", "model": args.model, "max_tokens": args.max_tokens,
              "k": args.k, "repeats": args.repeats, "machine_before": machine_info(), "rows": []}
    configs = _configs(args.configs.split(","), args.k, args.layer_skip_layers)
    for workload in args.workloads.split(","):
        for batch in sizes:
            decoders = {"none": None}
            for name, cfg in configs.items():       # fresh counters per row
                decoders[name] = build_spec_decoder(cfg, engine.runner, engine.max_model_len,
                                                    engine.scheduler.kv.num_total_blocks)
            prompts = _prompts(engine.tokenizer, workload, batch)
            row = {"workload": workload, "batch": batch, **_measure(llm, decoders, prompts, args),
                   "load_avg_1m": machine_info()["load_avg_1m"]}
            print(row, flush=True)
            result["rows"].append(row)
    result["machine_after"] = machine_info()
    emit(result, args.json)
    return 0
