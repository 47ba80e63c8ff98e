"""`tokenmill bench structured`: what a JSON-schema constraint costs.

- Throughput at batch 1 and 16: output tok/s of the same prompts with and without a schema,
  and with the schema but no forced-token drafts (medians of alternating runs, so drift in
  machine load hits all). The schema is a long array, so every run generates exactly
  ``--output-len`` tokens per request: the ratios are the cost of masks per token and the
  gain of verifying forced tokens in one forward, not of different lengths.
- Compile time p50 / p99 over seeded random schemas (tokenmill.bench.schemas) with a cold
  cache: compile plus the first mask, where llguidance does its lazy work.
"""
from __future__ import annotations

import random
import statistics
import time

from tokenmill.bench.common import emit, machine_info
from tokenmill.bench.report import Chart, add_output_args, progress
from tokenmill.bench.schemas import random_schema

LONG_LIST = {"type": "array", "minItems": 200, "maxItems": 200, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
    "properties": {"name": {"type": "string", "maxLength": 24},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "city": {"type": "string", "maxLength": 24}}}}


def add_parser(sub) -> None:
    p = sub.add_parser("structured", help="cost of JSON-schema constrained decoding")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quantization", default=None)
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-schemas", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json", default=None)
    add_output_args(p)
    p.set_defaults(func=run)


def _prompts(tokenizer, batch: int) -> list[dict]:
    ask = "List {} people as JSON objects with a name, an age and a city."
    return [{"prompt_token_ids": tokenizer.apply_chat_template(
        [{"role": "user", "content": ask.format(20 + i)}], add_generation_prompt=True,
        tokenize=True)} for i in range(batch)]


def _tok_per_s(llm, prompts, params) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return tokens / seconds, tokens


def _throughput(llms: dict, batch: int, output_len: int, repeats: int) -> dict:
    """Median tok/s of ``repeats`` alternating runs on two engines alike but for forced-token
    drafts (on: the default; off: ``max_forced_drafts=0``), each running free decoding and
    the schema. Each ratio compares runs of one engine: two engine instances of one config
    differed by up to ~8% here. Alternating spreads drift in machine load over all runs."""
    from tokenmill import SamplingParams
    plain = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    constrained = plain.clone(structured_outputs={"json": LONG_LIST})
    prompts = _prompts(llms["forced"].get_tokenizer(), batch)
    runs = (("plain", llms["forced"], plain), ("json_schema", llms["forced"], constrained),
            ("plain_b", llms["no_forced"], plain),
            ("json_schema_no_forced", llms["no_forced"], constrained))
    rates: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for _ in range(repeats):
        for name, llm, params in runs:
            rate, tokens = _tok_per_s(llm, prompts, params)
            if tokens != batch * output_len:
                raise RuntimeError(f"{name} generated {tokens} tokens, expected {batch * output_len}")
            rates[name].append(rate)
    med = {name: statistics.median(values) for name, values in rates.items()}
    return {"batch": batch, "plain_tok_s": round(med["plain"], 1),
            "json_schema_tok_s": round(med["json_schema"], 1),
            "json_schema_no_forced_tok_s": round(med["json_schema_no_forced"], 1),
            "runs_tok_s": {k: [round(r, 1) for r in v] for k, v in rates.items()},
            "json_vs_plain": round(med["json_schema"] / med["plain"], 3),
            "no_forced_vs_plain": round(med["json_schema_no_forced"] / med["plain_b"], 3)}


def _compile_times(llm, num_schemas: int) -> dict:
    from tokenmill.structured.grammar import GrammarCompiler, fill_bitmasks
    from tokenmill.structured.params import StructuredOutputsParams
    rng = random.Random(0)
    compiler = GrammarCompiler(llm.get_tokenizer(), llm.engine.vocab_size)
    times = []
    for _ in range(num_schemas):
        spec = StructuredOutputsParams(json=random_schema(rng))
        t0 = time.perf_counter()
        matcher = compiler.compile(spec).new_matcher()
        fill_bitmasks([(matcher, [])], compiler.words_per_row)
        times.append(1000 * (time.perf_counter() - t0))
    times.sort()
    return {"num_schemas": num_schemas, "p50_ms": round(statistics.median(times), 2),
            "p99_ms": round(times[min(len(times) - 1, int(0.99 * len(times)))], 2),
            "max_ms": round(times[-1], 2)}


def run(args) -> int:
    from tokenmill import LLM
    batches = [int(b) for b in args.batch_sizes.split(",")]
    common = dict(model=args.model, quantization=args.quantization, num_threads=args.num_threads,
                  max_model_len=2048, max_num_seqs=max(batches))
    llms = {"forced": LLM(**common), "no_forced": LLM(**common, max_forced_drafts=0)}
    bar = progress(len(batches) + 1, "bench structured", args.progress)
    rows = []
    for batch in batches:
        rows.append(_throughput(llms, batch, args.output_len, args.repeats))
        bar.update()
    compile_stats = _compile_times(llms["forced"], args.num_schemas)
    bar.update()
    bar.close()
    emit({"bench": "structured", "model": args.model, "quantization": args.quantization,
          "output_len": args.output_len, "machine": machine_info(), "rows": rows,
          "compile": compile_stats},
         args.json, args.output_dir, rows=rows,
         chart=Chart("batch", ("plain_tok_s", "json_schema_tok_s", "json_schema_no_forced_tok_s"),
                     title=f"structured outputs, {args.model}"))
    return 0
