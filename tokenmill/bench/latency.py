"""`tokenmill bench latency`: batch-1 prefill tok/s and decode ms/token at several context
lengths, each beside this machine's physical floor measured in the same run. With
--torch-compile, a torch.compile'd engine is measured after the eager one: its rows carry
ratios to eager, and compile_s is its first calls' wall time beyond eager's (a warm-up
request and each length's first request, where compiling happens)."""
from __future__ import annotations

import time

from tokenmill.bench.common import (emit, machine_info, measure_bandwidth_gbps,
                                    measure_gemm_gflops, random_prompts)
from tokenmill.bench.report import Chart, add_output_args, progress


def add_parser(sub) -> None:
    p = sub.add_parser("latency", help="batch-1 prefill and decode speed vs the physical floor")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context-lens", default="128,512,1024")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--torch-compile", action="store_true",
                   help="also measure a torch.compile'd engine (and its compile time)")
    p.add_argument("--json", default=None)
    add_output_args(p)
    p.set_defaults(func=run)


def _one_request(engine, prompt, decode_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds per token) of one request alone."""
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens + 1, ignore_eos=True)
    engine.add_request(None, prompt, params)
    t0 = time.perf_counter()
    engine.step()                     # prefill + first token (budget covers the prompt)
    t1 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    t2 = time.perf_counter()
    return t1 - t0, (t2 - t1) / decode_tokens


def run(args) -> int:
    import statistics
    from tokenmill import LLM
    lens = [int(x) for x in args.context_lens.split(",")]
    modes = ["eager"] + (["torch.compile"] if args.torch_compile else [])

    def make(mode: str):
        return LLM(model=args.model, num_threads=args.num_threads,
                   max_num_batched_tokens=max(lens) + 1, skip_tokenizer_init=True,
                   max_model_len=max(lens) + args.decode_tokens + 8, enable_prefix_caching=False,
                   torch_compile=mode == "torch.compile").engine
    engine = make("eager")
    a = engine.model.args
    bandwidth = measure_bandwidth_gbps()
    gflops = measure_gemm_gflops()
    params = sum(p.numel() for p in {id(p): p for p in engine.model.parameters()}.values())
    kv_per_token = 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * engine.dtype.itemsize
    rows, first_calls = [], {}
    bar = progress(len(modes) * len(lens) * args.repeats, "bench latency", args.progress)
    for mode in modes:
        if mode != "eager":
            engine = make(mode)
        # first calls: a warm-up request, then each length's first repeat (a compiled engine
        # compiles on them); their excess over eager's is the compile time
        t0 = time.perf_counter()
        _one_request(engine, random_prompts(1, 16, a.vocab_size, seed=99)[0], 4)
        first = time.perf_counter() - t0
        for n in lens:
            samples = []
            for r in range(args.repeats + 1):
                t0 = time.perf_counter()
                sample = _one_request(engine, random_prompts(1, n, a.vocab_size, seed=r)[0],
                                      args.decode_tokens)
                if r == 0:
                    first += time.perf_counter() - t0
                else:
                    samples.append(sample)
                    bar.update()
            prefill_s = statistics.median(s[0] for s in samples)
            decode_s = statistics.median(s[1] for s in samples)
            decode_floor = (engine.decode_read_bytes + kv_per_token * (n + args.decode_tokens // 2)) / (bandwidth * 1e9)
            prefill_floor = 2 * params * n / (gflops * 1e9)
            rows.append({"mode": mode, "context_len": n, "prefill_tok_s": round(n / prefill_s, 1),
                         "prefill_x_floor": round(prefill_s / prefill_floor, 2),
                         "decode_ms_per_token": round(decode_s * 1e3, 2),
                         "decode_tok_s": round(1 / decode_s, 1),
                         "decode_x_floor": round(decode_s / decode_floor, 2)})
        first_calls[mode] = first
    bar.close()
    result = {"bench": "latency", "model": args.model, "bandwidth_gb_s": round(bandwidth, 1),
              "gemm_gflops": round(gflops, 1), "weight_bytes": engine.weight_bytes,
              "decode_read_bytes": engine.decode_read_bytes,
              "first_calls_s": {m: round(v, 2) for m, v in first_calls.items()}}
    if args.torch_compile:
        result["compile_s"] = round(first_calls["torch.compile"] - first_calls["eager"], 1)
        eager = {r["context_len"]: r for r in rows if r["mode"] == "eager"}
        for r in rows:
            if r["mode"] != "eager":
                base = eager[r["context_len"]]
                r["prefill_vs_eager"] = round(r["prefill_tok_s"] / base["prefill_tok_s"], 2)
                r["decode_vs_eager"] = round(r["decode_tok_s"] / base["decode_tok_s"], 2)
    result.update(machine=machine_info(), rows=rows)
    emit(result, args.json, args.output_dir,
         chart=Chart("context_len", ("prefill_tok_s", "decode_tok_s", "prefill_x_floor",
                                     "decode_x_floor"), kind="line", series="mode",
                     title=f"latency, {args.model}"))
    return 0
