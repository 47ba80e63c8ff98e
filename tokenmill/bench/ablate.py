"""`tokenmill bench ablate`: one offline workload run with each optimisation switched off in
turn, beside the same engine with everything on, in the same run (on and off alternate, ABBA,
medians of --repeats after a warm-up). Gain = on / off output tok/s; itl_p99_gain and
ttft_p50_gain = off / on latency (> 1: the optimisation helps).

Ablations (--only picks some):
  paged_kv            off: each request reserves max_model_len of KV up front (one block of
                      max_model_len tokens), same KV memory, so fewer requests fit at once
  continuous_batching off: static batches, the next wave of max_num_seqs requests starts only
                      when the whole wave has finished
  chunked_prefill     off: step budget >= every prompt that can be admitted together, so no
                      prompt is ever split (on: --max-num-batched-tokens)
  prefix_caching      off: no prefix cache, on ShareGPT turns behind one shared system prompt
  spec_decode         off: no n-gram speculation, on input-grounded (copy / rewrite) tasks
  quantization        on: GGUF blocks kept packed (--quant-scheme) vs off: float32
  cpu_fast_paths      off: plain-PyTorch reference attention, no fused C kernels and no
                      prepacked weights
  weight_prepack      off: float32 linears multiply by MKL on the plain weights, without the
                      oneDNN-layout copy (cpu_weight_prepack=False); a quantized model's
                      packed linears are the same either way
  q8_tiles            on: --quant-scheme weights with q8 activations, int8 / int4 linears on
                      the tiled q8 GEMM (layers/quant/qgemm.py) at every row count; off: the
                      same without tiles (streaming q8 kernel for decode-sized steps,
                      dequantize + float GEMM beyond)
  window_pools        off: sliding-window layers keep the whole context in the one table of
                      every layer (sliding_window_pools=False), same KV bytes; on: they keep
                      their window, in pools of their own, so more long requests fit. The
                      pool holds a quarter of what every seat's longest request needs
                      (--kv-budget-tokens overrides). On = off for a model without windows

The workload: --num-prompts ShareGPT first turns, each with its reference answer's length
(capped at --output-len; --fixed-output-len for all the same), all arriving at once, with
--max-num-seqs seats. Each workload's KV pool holds what paging needs to fill every seat
with its longest request (--kv-budget-tokens overrides), the contiguous variant the same
memory.

    tokenmill bench ablate --model smollm2-135m --num-prompts 32 --output-len 128
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

from tokenmill.bench.report import Chart, add_output_args, markdown_table, progress
from tokenmill.bench.workloads import (SYSTEM_PROMPT, Workload, grounded_tasks, random_grounded,
                                       random_turns, sharegpt_turns)

ABLATIONS = ("paged_kv", "continuous_batching", "chunked_prefill", "prefix_caching",
             "spec_decode", "quantization", "cpu_fast_paths", "weight_prepack", "q8_tiles",
             "window_pools")
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}


def add_parser(sub) -> None:
    p = sub.add_parser("ablate", help="each optimisation switched off in turn: its measured gain",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--only", default=",".join(ABLATIONS), help="comma list of ablations")
    p.add_argument("--dataset", choices=["sharegpt", "random"], default="sharegpt")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128, help="cap (or, fixed, the length)")
    p.add_argument("--fixed-output-len", action="store_true")
    p.add_argument("--max-input-len", type=int, default=384)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=1024, help="<= 1024 (the largest block)")
    p.add_argument("--kv-budget-tokens", type=int, default=None)
    p.add_argument("--quantization", default=None, help="of the all-on engine (default fp32)")
    p.add_argument("--quant-scheme", default="auto", help="quantization ablation (auto: gguf for a "
                   ".gguf model, else int8)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    add_output_args(p)
    p.set_defaults(func=run)


# -- running a workload ---------------------------------------------------------------------------
def _pct(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def drive(llm, work: Workload, wave: Optional[int] = None) -> dict:
    """Run a workload to the end, step by step. All requests arrive at t0 (``wave``: only that
    many are queued at a time, the next wave when the engine is idle = static batching).
    Returns output tok/s, TTFT since t0, inter-token gaps and the most requests running."""
    from tokenmill import SamplingParams
    engine = llm.engine
    queue = [({"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
             for p, n in zip(work.prompts, work.output_lens)]
    seen: dict[str, int] = {}
    last: dict[str, float] = {}
    ttfts, gaps = [], []
    peak = num_out = 0
    t0 = time.perf_counter()
    while queue or engine.has_unfinished_requests():
        if queue and (wave is None or not engine.has_unfinished_requests()):
            take, queue = (queue, []) if wave is None else (queue[:wave], queue[wave:])
            for prompt, params in take:
                engine.add_request(None, prompt, params)
        outs = engine.step()
        now = time.perf_counter()
        peak = max(peak, len(getattr(engine.scheduler, "running", ())))
        for out in outs:
            n = len(out.outputs[0].token_ids)
            if n > seen.get(out.request_id, 0):
                if out.request_id in last:
                    gaps.append(now - last[out.request_id])
                else:
                    ttfts.append(now - t0)
                num_out += n - seen.get(out.request_id, 0)
                seen[out.request_id], last[out.request_id] = n, now
    wall = time.perf_counter() - t0
    return {"tok_s": num_out / wall, "wall_s": wall, "ttft_p50_s": _pct(ttfts, 0.5),
            "itl_p50_s": _pct(gaps, 0.5), "itl_p99_s": _pct(gaps, 0.99), "peak_running": peak}


@dataclass
class Variant:
    llm: object
    wave: Optional[int] = None                       # static batching wave size
    before_run: Callable[[], None] = lambda: None   # e.g. empty the prefix cache


def _reset_prefix_cache(llm) -> Callable[[], None]:
    def reset() -> None:
        kv = getattr(llm.engine.scheduler, "kv", None)
        if kv is not None:
            kv.reset_prefix_cache()     # each run starts cold, as the first one did
    return reset


def measure_pair(on: Variant, off: Variant, work: Workload, repeats: int, bar) -> dict:
    """Warm both up, then on/off in ABBA order; medians and gains."""
    for v in (on, off):
        v.before_run()
        drive(v.llm, work.head(2, 4), v.wave)
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for r in range(repeats):
        for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
            v = on if name == "on" else off
            v.before_run()
            runs[name].append(drive(v.llm, work, v.wave))
            bar.update()
    med = {name: {k: statistics.median(x[k] for x in rs if x[k] is not None)
                  if any(x[k] is not None for x in rs) else None for k in rs[0]}
           for name, rs in runs.items()}

    def ratio(a, b) -> Optional[float]:
        return round(a / b, 3) if a and b else None
    return {"on_tok_s": round(med["on"]["tok_s"], 2), "off_tok_s": round(med["off"]["tok_s"], 2),
            "gain": ratio(med["on"]["tok_s"], med["off"]["tok_s"]),
            "ttft_p50_gain": ratio(med["off"]["ttft_p50_s"], med["on"]["ttft_p50_s"]),
            "itl_p99_gain": ratio(med["off"]["itl_p99_s"], med["on"]["itl_p99_s"]),
            "on_peak_running": med["on"]["peak_running"], "off_peak_running": med["off"]["peak_running"],
            "on_runs_tok_s": [round(x["tok_s"], 2) for x in runs["on"]],
            "off_runs_tok_s": [round(x["tok_s"], 2) for x in runs["off"]]}


# -- the ablations ----------------------------------------------------------------------------------
class Context:
    """Model, workloads and the all-on engine, shared by every ablation."""

    def __init__(self, args) -> None:
        from tokenmill.models.hub import resolve_model
        from tokenmill.models.loader import load_tokenizer, open_checkpoint
        self.args = args
        self.path = resolve_model(args.model)
        self.is_gguf = self.path.endswith(".gguf")
        hf = open_checkpoint(self.path).hf_config
        self.max_model_len = min(args.max_model_len, hf.get("max_position_embeddings") or 2048)
        self.tokenizer = load_tokenizer(self.path) if args.dataset == "sharegpt" else None
        self.vocab = hf["vocab_size"]
        self._workloads: dict[str, Workload] = {}
        self._convs = None
        self.base = None

    def workload(self, kind: str) -> Workload:
        if kind not in self._workloads:
            self._workloads[kind] = self._make(kind)
        return self._workloads[kind]

    def _make(self, kind: str) -> Workload:
        a, tok = self.args, self.tokenizer
        if kind == "grounded":
            return (grounded_tasks(tok, a.num_prompts, a.output_len) if tok else
                    random_grounded(self.vocab, a.num_prompts, a.max_input_len, a.output_len, a.seed))
        system = SYSTEM_PROMPT if kind == "shared_prefix" else None
        if tok is None:
            return random_turns(self.vocab, a.num_prompts, a.max_input_len, a.output_len,
                                a.fixed_output_len, a.seed, shared_prefix=64 if system else 0)
        if self._convs is None:
            from tokenmill.data.sharegpt import conversations
            self._convs = conversations("benchmark", limit=max(200, 20 * a.num_prompts))
        extra = len(tok.encode(SYSTEM_PROMPT)) + 8 if system else 0
        return sharegpt_turns(tok, self._convs, a.num_prompts, a.max_input_len + extra,
                              a.output_len, a.fixed_output_len, a.seed, system=system)

    def budget_tokens(self, kind: str = "main") -> int:
        """KV tokens of the pool: what paging needs to fill every seat with the workload's
        longest request."""
        if self.args.kv_budget_tokens:
            return self.args.kv_budget_tokens
        need = self.workload(kind).max_need + SPEC["num_speculative_tokens"] + 1
        return self.args.max_num_seqs * -(-need // 16) * 16

    def llm(self, kind: str = "main", **overrides):
        from tokenmill import LLM
        a = self.args
        kw = dict(model=self.path, num_threads=a.num_threads, max_model_len=self.max_model_len,
                  max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                  block_size=16, num_kv_blocks=self.budget_tokens(kind) // 16,
                  enable_prefix_caching=True, quantization=a.quantization,
                  skip_tokenizer_init=True, seed=a.seed)
        kw.update(overrides)
        return LLM(**kw)

    def base_variant(self) -> Variant:
        if self.base is None:
            self.base = self.llm()
        return Variant(self.base, before_run=_reset_prefix_cache(self.base))


def _variants(ctx: Context, name: str):
    """(workload kind, "on" variant, "off" variant, what is off) of one ablation. The all-on
    engine of the main workload is shared; the other workloads get engines sized for them."""
    a = ctx.args
    base = ctx.base_variant() if name not in ("prefix_caching", "spec_decode") else None
    if name == "paged_kv":
        if ctx.max_model_len > 1024:
            raise ValueError("paged_kv needs --max-model-len <= 1024 (the largest block)")
        fit = ctx.budget_tokens() // ctx.max_model_len   # requests the same memory holds
        llm = ctx.llm(block_size=ctx.max_model_len, num_kv_blocks=max(1, fit))
        return "main", base, Variant(llm, before_run=_reset_prefix_cache(llm)), \
            f"contiguous: {ctx.max_model_len} KV tokens reserved per request" + \
            ("" if fit else " (given 1 request's worth: more memory than paged)")
    if name == "continuous_batching":
        return "main", base, Variant(base.llm, wave=a.max_num_seqs, before_run=base.before_run), \
            f"static waves of {a.max_num_seqs}"
    if name == "chunked_prefill":
        longest = max(len(p) for p in ctx.workload("main").prompts)
        budget = max(a.max_num_batched_tokens, a.max_num_seqs * (longest + 1))
        llm = ctx.llm(max_num_batched_tokens=budget)
        return "main", base, Variant(llm, before_run=_reset_prefix_cache(llm)), \
            f"step budget {budget} (no prompt split)" + \
            (" = on: nothing to split here" if budget == a.max_num_batched_tokens else "")
    if name == "prefix_caching":
        on = ctx.llm("shared_prefix")
        return "shared_prefix", Variant(on, before_run=_reset_prefix_cache(on)), \
            Variant(ctx.llm("shared_prefix", enable_prefix_caching=False)), "no prefix cache"
    if name == "spec_decode":
        on, off = ctx.llm("grounded", speculative_config=dict(SPEC)), ctx.llm("grounded")
        return "grounded", Variant(on, before_run=_reset_prefix_cache(on)), \
            Variant(off, before_run=_reset_prefix_cache(off)), "no speculation"
    if name == "quantization":
        scheme = a.quant_scheme if a.quant_scheme != "auto" else ("gguf" if ctx.is_gguf else "int8")
        on = ctx.llm(quantization=scheme)
        off = ctx.llm(quantization=None) if a.quantization else base.llm
        return "main", Variant(on, before_run=_reset_prefix_cache(on)), \
            Variant(off, before_run=_reset_prefix_cache(off)), f"float32 (on: {scheme})"
    if name == "cpu_fast_paths":
        llm = ctx.llm(attention_backend="reference", cpu_kernels=False, cpu_weight_prepack=False)
        return "main", base, Variant(llm, before_run=_reset_prefix_cache(llm)), \
            "reference attention, no fused C kernels (norm, rope, silu, GEMV, paged attention, one-call decode stack), no prepacked weights"
    if name == "weight_prepack":
        llm = ctx.llm(cpu_weight_prepack=False)
        return "main", base, Variant(llm, before_run=_reset_prefix_cache(llm)), \
            "MKL on plain float32 weights (no oneDNN-layout copy)"
    if name == "q8_tiles":
        scheme = a.quant_scheme if a.quant_scheme != "auto" else ("gguf" if ctx.is_gguf else "int8")
        on = ctx.llm(quantization=scheme, quant_activations="q8")
        off = ctx.llm(quantization=scheme, quant_activations="q8", cpu_weight_prepack=False)
        return "main", Variant(on, before_run=_reset_prefix_cache(on)), \
            Variant(off, before_run=_reset_prefix_cache(off)), \
            f"{scheme}, q8 activations without the tiled GEMM"
    if name == "window_pools":
        return ("main", *_window_pool_variants(ctx, base))
    raise ValueError(f"unknown ablation {name!r}; choose from {', '.join(ABLATIONS)}")


def _window_pool_variants(ctx: Context, base: Variant) -> tuple:
    """The same KV bytes both ways: what one table over every layer holds in a quarter of
    the seats' need (or --kv-budget-tokens), split into window pools (on) or not (off)."""
    if all(w is None for w in base.llm.engine.kv_layout.layer_windows):
        return base, base, "no sliding-window layers: on = off"
    blocks = (ctx.args.kv_budget_tokens or ctx.budget_tokens() // 4) // 16
    off = ctx.llm(num_kv_blocks=blocks, sliding_window_pools=False)
    memory = blocks * 16 * off.get_memory_stats()["kv_bytes_per_token"]
    on = ctx.llm(num_kv_blocks=None, kv_cache_memory=memory)
    groups = ", ".join(f"{len(g.layers)} layers x {g.num_blocks} blocks"
                       + (f" (window {g.window})" if g.window else "") for g in on.engine.kv_layout.groups)
    return Variant(on, before_run=_reset_prefix_cache(on)), Variant(off, before_run=_reset_prefix_cache(off)), \
        f"one table of {blocks} blocks for all layers; on: {groups}"


def run(args) -> int:
    from tokenmill.bench.common import emit, machine_info
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(ABLATIONS))
    if unknown:
        raise ValueError(f"unknown ablation(s) {unknown}; choose from {', '.join(ABLATIONS)}")
    ctx = Context(args)
    machine = machine_info()
    rows = []
    bar = progress(2 * args.repeats * len(names), "bench ablate", args.progress)
    for name in names:
        bar.set_postfix_str(name)
        kind, on, off, what = _variants(ctx, name)
        work = ctx.workload(kind)
        row = {"ablation": name, "off": what, "workload": work.name,
               **measure_pair(on, off, work, args.repeats, bar),
               "load_avg_1m": machine_info()["load_avg_1m"]}
        rows.append(row)
        del on, off
        gc.collect()
    bar.close()
    result = {"bench": "ablate", "model": args.model, "num_prompts": args.num_prompts,
              "output_len": args.output_len, "fixed_output_len": args.fixed_output_len,
              "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens,
              "max_model_len": ctx.max_model_len, "kv_budget_tokens": ctx.budget_tokens(),
              "repeats": args.repeats, "machine": machine, "machine_after": machine_info(),
              "rows": rows}
    table = [{k: r[k] for k in ("ablation", "off", "workload", "on_tok_s", "off_tok_s", "gain",
                                "itl_p99_gain", "ttft_p50_gain", "on_peak_running",
                                "off_peak_running")} for r in rows]
    print(markdown_table(table), file=sys.stderr)
    emit(result, args.json, args.output_dir, rows=table,
         chart=Chart("ablation", ("gain", "itl_p99_gain", "ttft_p50_gain"),
                     title=f"bench ablate: gain of each optimisation (on / off), {args.model}"))
    return 0
