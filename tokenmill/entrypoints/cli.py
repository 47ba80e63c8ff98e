"""`tokenmill` command line: generate, chat, pull, upcycle (serve, bench, verify-spec,
train-drafter, quantize and env register their own parsers)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from tokenmill.config import ATTENTION_BACKENDS, CPU_ISAS, DEVICES, KV_CACHE_DTYPES


def _default_cache_dir() -> Optional[str]:
    # The CLI is the one place env vars are read: each becomes an explicit argument.
    return os.environ.get("TOKENMILL_CACHE")


def _env_default(name: str, choices: tuple, fallback: str) -> str:
    """A flag's default from the environment (for scripts that set it once), validated."""
    value = os.environ.get(name, fallback)
    if value not in choices:
        raise SystemExit(f"tokenmill: {name}={value!r} must be one of {', '.join(choices)}")
    return value


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="smollm2-135m",
                   help="model name (see `tokenmill pull --list`), HF directory or .gguf file")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--device", default="auto", choices=list(DEVICES),
                   help="auto = CUDA when a GPU is visible, else the CPU")
    g.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKENDS),
                   help="auto = triton on CUDA (when the triton package is installed), "
                        "else cpu; triton = Triton kernels (on a CPU only in Triton's "
                        "interpreter, for tests); reference = plain PyTorch")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy = random weights from the model directory's config.json "
                        "(speed measurements at any size)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode steps eagerly instead of replaying captured CUDA graphs")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache size in bytes")
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV cache storage: model dtype (auto), fp16 / bf16 (half the bytes "
                        "of float32), or int8 / fp8 (E4M3) with per-token per-head scales, ~4x "
                        "the tokens of float32")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-forced-drafts", type=int, default=8,
                   help="tokens a request's grammar forces next, verified as drafts in one "
                        "forward (structured outputs; exact); 0 = off")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--sliding-window-pools", action=argparse.BooleanOptionalAction, default=True,
                   help="sliding-window layers keep only their window's KV blocks, in pools of "
                        "their own (--no-sliding-window-pools: every layer keeps the whole context)")
    g.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--quantization", default=None,
                   help="weights: int8, int4, int4-g32|g64|g128, fp8 (online RTN), bf16 / fp16 "
                        "(16-bit weights, float32 activations) or gguf (keep a GGUF's Q8_0 / Q4_0 / "
                        "Q4_1 blocks packed); GPTQ / AWQ / FP8 checkpoints need none")
    g.add_argument("--quant-activations", choices=["fp32", "q8"],
                   default=_env_default("TOKENMILL_QMM_ACTIVATIONS", ("fp32", "q8"), "fp32"),
                   help="activations of int8 / int4 weight matmuls: fp32 (exact, default) or q8 "
                        "(int8 per 32 values, integer dot products as llama.cpp: faster); "
                        "default from TOKENMILL_QMM_ACTIVATIONS")
    g.add_argument("--cpu-kernels", action=argparse.BooleanOptionalAction,
                   default=_env_default("TOKENMILL_CPU_KERNELS", ("0", "1"), "1") == "1",
                   help="fused C kernels for norms, RoPE, SiLU, small matmuls, paged attention "
                        "and the one-call decode stack (default on; TOKENMILL_CPU_KERNELS=0 "
                        "turns the default off)")
    g.add_argument("--torch-compile", action="store_true",
                   help="torch.compile the per-layer path (prefill); first use of each shape "
                        "class compiles for tens of seconds")
    g.add_argument("--no-cpu-weight-prepack", dest="cpu_weight_prepack", action="store_false",
                   help="don't keep a oneDNN-layout copy of float32 weights for prefill / batched "
                        "matmuls, nor the tiled int8 / int4 copy of q8 linears (saves that memory; "
                        "batched GEMMs up to 2-3x slower)")
    g.add_argument("--no-huge-pages", dest="huge_pages", action="store_false",
                   help="keep weights and the KV cache on ordinary 4 KB pages (default: 2 MB "
                        "transparent huge pages on Linux, faster decode; the KV cache's resident "
                        "memory then grows 2 MB at a time per layer)")
    g.add_argument("--cpu-gemm-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="bfloat16 (CPUs with AVX-512 BF16 only): every float matmul on a "
                        "tiled bf16 copy, activations rounded to bf16, fp32 sums: faster "
                        "prefill, batches and decode, small accuracy cost")
    g.add_argument("--cpu-isa", default="native", choices=CPU_ISAS,
                   help="instruction sets of the CPU kernels: native (all this CPU has), avx512 "
                        "(no AMX tiles: bf16 mode on AVX-512 BF16, as on Zen 4) or avx2 (the "
                        "build an AVX2-only CPU runs, no AVX-512 path): to measure or check "
                        "another CPU's code on this one")
    g.add_argument("--speculative-config", default=None,
                   help='speculative decoding, JSON: e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    g.add_argument("--speculative-model", default=None, help="draft model, or [ngram] for prompt lookup")
    g.add_argument("--num-speculative-tokens", type=int, default=None)
    _add_parallel_args(p)


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split each layer over this many worker processes (inside one node)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="whole-engine replicas; each request goes to one of them")
    g.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default="mp",
                   help="replicas as local processes (mp) or Ray actors, possibly on other "
                        "nodes (ray)")
    g.add_argument("--router", choices=["prefix", "round_robin"], default="prefix",
                   help="how requests pick a data-parallel replica: prefix = requests sharing "
                        "their first KV blocks go to the same one (its prefix cache hits)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: shard whole experts over the tensor-parallel ranks instead "
                        "of slicing every expert (attention stays split by heads)")
    g.add_argument("--replicate-hot-experts", type=int, default=0, metavar="K",
                   help="with --enable-expert-parallel: copy each layer's K most used experts "
                        "(measured while serving) onto every rank, which split their tokens")
    g.add_argument("--expert-rebalance-interval", type=int, default=256, metavar="STEPS",
                   help="engine steps between looks at the expert load")
    g.add_argument("--ray-address", default=None,
                   help="Ray cluster to join ('auto' = the one `ray start` runs here; default: "
                        "start a local one)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _make_llm(args):
    from tokenmill.entrypoints.llm import LLM
    return LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
               device=args.device, attention_backend=args.attention_backend,
               enforce_eager=args.enforce_eager, load_format=args.load_format,
               block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
               kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
               gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens,
               max_forced_drafts=args.max_forced_drafts,
               enable_prefix_caching=args.enable_prefix_caching,
               sliding_window_pools=args.sliding_window_pools, seed=args.seed,
               num_threads=args.num_threads, cache_dir=_default_cache_dir(),
               quantization=args.quantization, quant_activations=args.quant_activations,
               torch_compile=args.torch_compile, cpu_weight_prepack=args.cpu_weight_prepack,
               cpu_gemm_dtype=args.cpu_gemm_dtype, cpu_isa=args.cpu_isa,
               huge_pages=args.huge_pages, cpu_kernels=args.cpu_kernels,
               speculative_config=_json_arg("--speculative-config", args.speculative_config),
               speculative_model=args.speculative_model,
               num_speculative_tokens=args.num_speculative_tokens,
               tensor_parallel_size=args.tensor_parallel_size,
               data_parallel_size=args.data_parallel_size,
               distributed_executor_backend=args.distributed_executor_backend,
               router=args.router, ray_address=args.ray_address,
               enable_expert_parallel=args.enable_expert_parallel,
               replicate_hot_experts=args.replicate_hot_experts,
               expert_rebalance_interval=args.expert_rebalance_interval)


def _json_arg(flag: str, text):
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON ({e})") from None


def _sampling_params(args):
    from tokenmill.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.sampling_seed,
                          stop=args.stop)


def load_llm(args, logger_name: str = "tokenmill.cli"):
    """The engine flags' LLM, saying what happens: the model fetched first if it is a known
    name not yet cached (with a progress report on stderr), then the load time."""
    import logging
    from tokenmill.models.hub import resolve_model
    from tokenmill.utils.progress import BarProgress, timed_load
    log = logging.getLogger(logger_name)
    resolve_model(args.model, _default_cache_dir(), progress=BarProgress(log, sys.stderr))
    return timed_load(args.model, lambda: _make_llm(args), log)


def cmd_generate(args) -> int:
    llm = load_llm(args)
    params = _sampling_params(args)
    prompts = args.prompt or ["The capital of France is"]
    if args.chat:
        outputs = [llm.chat([{"role": "user", "content": p}], params, use_tqdm=False)[0]
                   for p in prompts]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.outputs[0].text,
                              "token_ids": out.outputs[0].token_ids,
                              "finish_reason": out.outputs[0].finish_reason}))
        else:
            print(f"--- prompt: {prompt!r}\n{out.outputs[0].text}\n"
                  f"[finish_reason={out.outputs[0].finish_reason}, "
                  f"tokens={len(out.outputs[0].token_ids)}]")
    if args.stats:
        print(json.dumps({"stats": llm.get_stats(), "memory": llm.get_memory_stats()}, indent=2))
    return 0


def cmd_chat(args) -> int:
    llm = load_llm(args)
    params = _sampling_params(args)
    tokenizer = llm.get_tokenizer()
    history = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("tokenmill chat — empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
        shown = ""
        for out in llm.stream({"prompt_token_ids": ids}, params):
            text = out.outputs[0].text
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": shown})
    return 0


def cmd_pull(args) -> int:
    from tokenmill.models.hub import KNOWN_MODELS, pull
    if args.list or not args.name:
        for name in sorted(KNOWN_MODELS):
            print(name)
        return 0
    import logging
    from tokenmill.utils.progress import BarProgress
    progress = BarProgress(logging.getLogger("tokenmill.cli"), sys.stderr)
    print(pull(args.name, cache_dir=_default_cache_dir(), progress=progress))
    return 0


def cmd_upcycle(args) -> int:
    import logging
    from tokenmill.models.upcycle import UpcycleConfig, upcycle
    from tokenmill.utils.progress import BarProgress
    config = UpcycleConfig(num_experts=args.experts, top_k=args.top_k, perturb=args.perturb,
                           seed=args.seed, dtype=args.dtype, force=args.force)
    progress = BarProgress(logging.getLogger("tokenmill.cli"), sys.stderr)
    print(upcycle(args.model, args.out, config, cache_dir=_default_cache_dir(), progress=progress).line())
    return 0


def _add_upcycle_parser(sub) -> None:
    u = sub.add_parser("upcycle", help="make a Mixtral-format MoE checkpoint from a dense Llama model",
                       description="Every expert starts as a copy of the dense FFN; with --perturb 0 "
                                   "the MoE computes exactly the dense model.")
    u.add_argument("model", metavar="MODEL", help="model name, HF directory or .gguf file (Llama architecture)")
    u.add_argument("out", metavar="OUT", help="output directory (HF Mixtral checkpoint)")
    u.add_argument("--experts", type=int, required=True, help="experts per layer")
    u.add_argument("--top-k", type=int, required=True, help="experts per token, in [1, --experts]")
    u.add_argument("--perturb", type=float, default=0.0,
                   help="scale each expert weight by (1 + p * N(0,1)), seeded per expert (0: identical experts)")
    u.add_argument("--seed", type=int, default=0, help="seed of the routers and the expert noise")
    u.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="written tensors (auto: the source's; float32 for a GGUF)")
    u.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    u.set_defaults(func=cmd_upcycle)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate completions for prompts (offline)")
    _add_engine_args(g)
    _add_sampling_args(g)
    g.add_argument("prompt", nargs="*", help="prompt text(s)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    g.add_argument("--json", action="store_true", help="one JSON object per output")
    g.add_argument("--stats", action="store_true", help="print engine and memory stats")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive chat that streams tokens")
    _add_engine_args(c)
    _add_sampling_args(c)
    c.add_argument("--system", default=None, help="system prompt")
    c.set_defaults(func=cmd_chat)
    p = sub.add_parser("pull", help="fetch a named model into the local cache")
    p.add_argument("name", nargs="?")
    p.add_argument("--list", action="store_true", help="list known model names")
    p.set_defaults(func=cmd_pull)
    from tokenmill.entrypoints.openai.cli_serve import add_serve_parser
    add_serve_parser(sub)
    _add_bench_parsers(sub)
    from tokenmill.spec.cli import add_verify_spec_parser
    add_verify_spec_parser(sub)
    from tokenmill.spec.train.cli import add_train_drafter_parser
    add_train_drafter_parser(sub)
    from tokenmill.entrypoints.cli_quant import add_quant_parsers
    add_quant_parsers(sub)
    from tokenmill.entrypoints.cli_env import add_env_parser
    add_env_parser(sub)
    _add_upcycle_parser(sub)
    return parser


def _add_bench_parsers(sub) -> None:
    from tokenmill.bench import latency, prefix, throughput
    bench = sub.add_parser("bench", help="benchmarks (ratios measured in one run)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    throughput.add_parser(bench_sub)
    latency.add_parser(bench_sub)
    prefix.add_parser(bench_sub)
    from tokenmill.spec import bench as spec_bench
    spec_bench.add_parser(bench_sub)
    from tokenmill.bench import quant
    quant.add_parser(bench_sub)
    from tokenmill.bench.serve import add_bench_serve_parser
    add_bench_serve_parser(bench_sub)
    from tokenmill.bench import ablate, compare
    compare.add_parser(bench_sub)
    ablate.add_parser(bench_sub)
    from tokenmill.bench import collectives
    collectives.add_parser(bench_sub)
    from tokenmill.bench import routing
    routing.add_parser(bench_sub)
    from tokenmill.bench import gpu
    gpu.add_parser(bench_sub)
    from tokenmill.bench import moe
    moe.add_parser(bench_sub)
    from tokenmill.bench import structured
    structured.add_parser(bench_sub)
    from tokenmill.bench import soak
    soak.add_parser(bench_sub)


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    import logging
    # tokenmill's own INFO lines (model fetch, load time, serve's URL) on stderr; other
    # libraries stay at WARNING. A no-op where logging is already set up (e.g. under pytest).
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("tokenmill").setLevel(getattr(args, "log_level", "info").upper())
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
