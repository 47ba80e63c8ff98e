"""`tokenmill quantize` and `tokenmill eval ppl` sub-commands (wired into cli.build_parser by
``add_quantize_parser(sub)`` and ``add_eval_parser(sub)``)."""
from __future__ import annotations

import argparse
import json
import os

from tokenmill.config import CPU_ISAS, KV_CACHE_DTYPES


def _cache_dir():
    return os.environ.get("TOKENMILL_CACHE")   # the CLI is the one place env vars are read


def add_quantize_parser(sub) -> None:
    p = sub.add_parser("quantize", help="write a GPTQ / AWQ / FP8 / RTN quantized checkpoint")
    p.add_argument("--model", default="smollm2-135m", help="name, HF directory or .gguf file")
    p.add_argument("--method", required=True, choices=["rtn", "gptq", "awq", "fp8"])
    p.add_argument("--bits", type=int, default=4, choices=[4, 8])
    p.add_argument("--group-size", type=int, default=128, help="-1: per channel")
    p.add_argument("--calib-samples", type=int, default=64, help="calibration windows")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window")
    p.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=True,
                   help="GPTQ: quantize salient columns first (default on: on SmolLM2 GPTQ "
                        "without it loses to RTN)")
    p.add_argument("--static-groups", action="store_true",
                   help="GPTQ: group grids from the original weights, so act-order keeps "
                        "contiguous groups (no input permutation at inference)")
    p.add_argument("--damp", type=float, default=0.01, help="GPTQ: Hessian damping fraction")
    p.add_argument("--output", required=True)
    p.set_defaults(func=cmd_quantize)


def cmd_quantize(args) -> int:
    from tokenmill.quantization.quantize import QuantizeArgs, quantize
    quantize(QuantizeArgs(model=args.model, method=args.method, output=args.output,
                          bits=args.bits, group_size=args.group_size,
                          calib_samples=args.calib_samples, seq_len=args.seq_len,
                          act_order=args.act_order, static_groups=args.static_groups,
                          damp=args.damp, cache_dir=_cache_dir()))
    return 0


def add_eval_parser(sub) -> None:
    ev = sub.add_parser("eval", help="model quality evaluations")
    ev_sub = ev.add_subparsers(dest="eval_command", required=True)
    p = ev_sub.add_parser("ppl", help="perplexity on the held-out ShareGPT split")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quantization", default=None, help="online scheme: int8, int4, int4-g32, fp8, bf16, fp16, gguf")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens scored")
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--kl-base", default=None,
                   help="also report KL(base || model) of next-token distributions; "
                        "'same' = this model unquantized")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="evaluate with a quantized KV cache (use with --chunk-size)")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="prefill tokens per step (default: a whole window); a small chunk "
                        "(64-128) makes later chunks read the KV cache back")
    p.add_argument("--quant-activations", default="fp32", choices=["fp32", "q8"],
                   help="activations of int8 / int4 weight matmuls (q8: llama.cpp's integer dots)")
    p.add_argument("--cpu-gemm-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="bfloat16: matmuls on a tiled bf16 copy (AVX-512 BF16 CPUs)")
    p.add_argument("--cpu-isa", default="native", choices=list(CPU_ISAS),
                   help="instruction sets of the CPU kernels (avx512: bf16 mode without AMX tiles)")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json", action="store_true", help="only the JSON line")
    p.set_defaults(func=cmd_eval_ppl)


def cmd_eval_ppl(args) -> int:
    from tokenmill.quantization.ppl import evaluate
    result = evaluate(args.model, args.quantization, args.max_tokens, args.context_len,
                      kl_base=args.kl_base, num_threads=args.num_threads, cache_dir=_cache_dir(),
                      kv_cache_dtype=args.kv_cache_dtype, chunk_size=args.chunk_size,
                      quant_activations=args.quant_activations, cpu_gemm_dtype=args.cpu_gemm_dtype,
                      cpu_isa=args.cpu_isa)
    if not args.json:
        for key, value in result.items():
            print(f"{key:>16}: {value}")
    print(json.dumps(result))
    return 0


def add_quant_parsers(sub) -> None:
    """Both sub-commands at once (what cli.build_parser calls)."""
    add_quantize_parser(sub)
    add_eval_parser(sub)
