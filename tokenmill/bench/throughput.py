"""`tokenmill bench throughput`: offline output tok/s of N requests with continuous batching
versus one request at a time (max_num_seqs=1), measured in the same process and run."""
from __future__ import annotations

import dataclasses
import time

from tokenmill.bench.common import emit, machine_info, median_of, random_prompts
from tokenmill.bench.report import Chart, add_output_args, progress


def add_parser(sub) -> None:
    p = sub.add_parser("throughput", help="offline throughput: continuous batching vs one at a time")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-baseline", action="store_true", help="don't run max_num_seqs=1")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas (processes); the one-at-a-time baseline is skipped")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="rank processes one model is split over (the cores are split too)")
    p.add_argument("--quantization", default=None, help="e.g. gguf, int8 (default: float)")
    p.add_argument("--json", default=None, help="also write the result to this file")
    add_output_args(p)
    p.set_defaults(func=run)


def _timed_generate(llm, prompts, params, bar) -> float:
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    bar.update()
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def run(args) -> int:
    from tokenmill import LLM, SamplingParams
    llm = LLM(model=args.model, max_num_seqs=args.max_num_seqs, num_threads=args.num_threads,
              skip_tokenizer_init=True, data_parallel_size=args.data_parallel_size,
              tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization,
              max_model_len=args.input_len + args.output_len + 16)
    vocab = llm.engine.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    # the baseline reseats one engine's scheduler; replicas' schedulers are in other processes
    args.skip_baseline = args.skip_baseline or args.data_parallel_size > 1
    sched = None if args.skip_baseline else llm.engine.scheduler
    result = {"bench": "throughput", "model": args.model, "num_prompts": args.num_prompts,
              "input_len": args.input_len, "output_len": args.output_len,
              "data_parallel_size": args.data_parallel_size,
              "tensor_parallel_size": args.tensor_parallel_size, "quantization": args.quantization,
              "machine": machine_info()}
    runs = args.repeats + 1 + (0 if args.skip_baseline else args.repeats)   # + 1 warm-up
    bar = progress(runs, "bench throughput", args.progress)
    cb, cb_all = median_of(lambda: _timed_generate(llm, prompts, params, bar), args.repeats)
    result["continuous_batching_output_tok_s"] = round(cb, 2)
    result["continuous_batching_runs"] = [round(v, 2) for v in cb_all]
    if not args.skip_baseline:
        full = sched.config
        sched.config = dataclasses.replace(full, max_num_seqs=1)   # same engine, one seat
        one, one_all = median_of(lambda: _timed_generate(llm, prompts, params, bar), args.repeats,
                                 warmup=0)
        sched.config = full
        result["one_at_a_time_output_tok_s"] = round(one, 2)
        result["one_at_a_time_runs"] = [round(v, 2) for v in one_all]
        result["speedup"] = round(cb / one, 2)
    bar.close()
    llm.engine.shutdown()
    result["machine_after"] = machine_info()
    rows = [{"mode": "continuous batching", "output_tok_s": result["continuous_batching_output_tok_s"]}]
    if "one_at_a_time_output_tok_s" in result:
        rows.append({"mode": "one at a time", "output_tok_s": result["one_at_a_time_output_tok_s"]})
    emit(result, args.json, args.output_dir, rows=rows,
         chart=Chart("mode", ("output_tok_s",), title=f"throughput, {args.model}"))
    return 0
