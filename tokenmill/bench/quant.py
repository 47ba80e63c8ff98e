"""`tokenmill bench quant`: decode (batch 1 and 16) and prefill speed of quantized weights vs
float32, every scheme loaded in one process and timed step by step in turn (interleaved), so
a load change on this shared machine hits all schemes alike. Ratios are vs "none" (fp32).

    python -m tokenmill.bench.quant --schemes none,int8,int4,gguf --num-threads 1
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from tokenmill.bench.common import emit, machine_info, measure_bandwidth_gbps, random_prompts
from tokenmill.bench.report import Chart, add_output_args, progress


def add_parser(sub) -> None:
    p = sub.add_parser("quant", help="quantized vs fp32 decode / prefill speed, one run")
    _args(p)
    p.set_defaults(func=run)


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--schemes", default="none,int8,int4,gguf",
                   help="comma list of: quantization values ('none' is the fp32 baseline), "
                        "quantized checkpoint directories (written by `tokenmill quantize`), "
                        "kv:bf16 / kv:fp16 / kv:int8 / kv:fp8 (fp32 weights, that KV cache); "
                        "a ':q8' suffix "
                        "runs a scheme with q8 activations (e.g. gguf:q8, int4-g32:q8)")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--prefill-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=15, help="timed decode steps per scheme")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json", default=None)
    add_output_args(p)


def scheme_settings(scheme: str, model: str) -> dict:
    """One --schemes entry -> LLM keyword arguments."""
    if scheme.endswith(":q8"):     # int8-rounded activations for the packed linears
        return {**scheme_settings(scheme[:-3], model), "quant_activations": "q8"}
    if scheme.startswith("kv:"):
        return {"model": model, "kv_cache_dtype": scheme[3:]}
    if os.path.isdir(scheme):      # a quantized checkpoint brings its own scheme
        return {"model": scheme}
    return {"model": model, "quantization": None if scheme == "none" else scheme}


def _engines(args) -> dict:
    from tokenmill import LLM
    engines = {}
    max_batch = max(int(b) for b in args.batch_sizes.split(","))
    # every decode request of the largest batch fits at once (long --prompt-len too)
    num_blocks = max(512, -(-max_batch * (args.prompt_len + args.steps + 24) // 16) + 16)
    for scheme in args.schemes.split(","):
        llm = LLM(**scheme_settings(scheme, args.model),
                  num_threads=args.num_threads, skip_tokenizer_init=True,
                  num_kv_blocks=num_blocks,
                  max_model_len=max(args.prefill_len, args.prompt_len + args.steps + 8) + 16,
                  max_num_batched_tokens=_max_batched_tokens(args),
                  enable_prefix_caching=False)
        engines[os.path.basename(scheme.rstrip("/")) if os.path.isdir(scheme) else scheme] = llm.engine
    return engines


def _max_batched_tokens(args) -> int:
    return max(args.prefill_len, args.prompt_len, 256) + 16


def _decode(engines: dict, batch: int, args) -> dict:
    """Median seconds of one decode step with ``batch`` running requests, interleaved."""
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    for engine in engines.values():
        vocab = engine.model.args.vocab_size
        for prompt in random_prompts(batch, args.prompt_len, vocab, seed=batch):
            engine.add_request(None, prompt, params)
        prefill_steps = -(-batch * args.prompt_len // _max_batched_tokens(args))
        for _ in range(prefill_steps + 2):   # the prompts' prefill, then warm-up decode steps
            engine.step()
    times = {name: [] for name in engines}
    for _ in range(args.steps):
        for name, engine in engines.items():
            t = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - t)
    for engine in engines.values():
        while engine.has_unfinished_requests():
            engine.step()
    return {name: statistics.median(ts) for name, ts in times.items()}


def _prefill(engines: dict, args, repeats: int = 3) -> dict:
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = {name: [] for name in engines}
    for r in range(repeats + 1):
        for name, engine in engines.items():
            prompt = random_prompts(1, args.prefill_len, engine.model.args.vocab_size, seed=100 + r)[0]
            engine.add_request(None, prompt, params)
            t = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            if r:                 # round 0 is the warm-up
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def run(args) -> int:
    engines = _engines(args)
    bandwidth = measure_bandwidth_gbps()
    result = {"bench": "quant", "model": args.model, "machine": machine_info(),
              "bandwidth_gbps": round(bandwidth, 1), "schemes": {}}
    for name, engine in engines.items():
        result["schemes"][name] = {"weight_bytes": engine.weight_bytes,
                                   "decode_read_bytes": engine.decode_read_bytes,
                                   "decode_floor_ms": round(engine.decode_read_bytes / bandwidth / 1e6, 2)}
    batches = [int(b) for b in args.batch_sizes.split(",")]
    bar = progress(len(batches) + 1, "bench quant", args.progress)
    for batch in batches:
        step = _decode(engines, batch, args)
        bar.update()
        base = step.get("none")
        for name, s in step.items():
            row, engine = result["schemes"][name], engines[name]
            row[f"decode_b{batch}_tok_s"] = round(batch / s, 1)
            # weights once, plus every request's cached K/V at its context (~prompt_len),
            # a sliding-window layer's over its window
            floor_bytes = engine.decode_read_bytes + batch * engine.kv_bytes_read(args.prompt_len)
            row[f"decode_b{batch}_x_floor"] = round(s / (floor_bytes / (bandwidth * 1e9)), 2)
            if base:
                row[f"decode_b{batch}_x_fp32"] = round(base / s, 2)
    prefill = _prefill(engines, args)
    bar.update()
    bar.close()
    for name, s in prefill.items():
        row = result["schemes"][name]
        row["prefill_tok_s"] = round(args.prefill_len / s, 1)
        if "none" in prefill:
            row["prefill_x_fp32"] = round(prefill["none"] / s, 2)
    result["machine_after"] = machine_info()
    metrics = tuple(f"decode_b{b}_tok_s" for b in batches) + ("prefill_tok_s",)
    emit(result, args.json, args.output_dir,
         rows=[{"scheme": name, **row} for name, row in result["schemes"].items()],
         chart=Chart("scheme", metrics, title=f"quantization, {args.model}"))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    _args(p)
    return run(p.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
