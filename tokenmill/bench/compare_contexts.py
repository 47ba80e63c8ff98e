"""`bench compare --contexts 512,2048,...`: prefill and batch-1 decode at long contexts.

Each engine row gets a second process of its own for these (one sequence, a context as long
as the longest asked for), so the main rows keep their KV pool and peak RSS, and this run
reports its own. For every context C: a random-token prompt of C tokens, run --repeats times
(medians): prefill tok/s = C / time to the first token, decode tok/s = the tokens after the
first over the time after it. tokenmill rows also get their floor at that context: weights
plus the K/V bytes a step reads (C + half the new tokens), over the measured read bandwidth
(the faster of a reading before and after the rows).
"""
from __future__ import annotations

import random
from typing import Optional

from tokenmill.bench.workloads import random_ids
from tokenmill.kv.layout import kv_bytes_read

CONTEXT_COLUMNS = ("name", "context", "status", "prefill_tok_s", "decode_tok_s", "decode_x_floor",
                   "peak_rss_mb", "tokenmill_vs.decode", "tokenmill_vs.prefill", "tokenmill_vs.against")


def decode_step_bytes(row: dict, context: int) -> int:
    """What a tokenmill row's batch-1 decode step reads at ``context`` tokens: its weights
    (``decode_weight_bytes`` where it streams fewer than it holds) and its K/V, a sliding-
    window layer's over its window only (``kv_layer_windows``; rows without it: every layer
    full). ``kv_bytes_per_token`` is every layer's, each layer the same share."""
    kv = kv_bytes_read(row["kv_bytes_per_token"], row.get("kv_layer_windows") or [None], context)
    return int(row.get("decode_weight_bytes", row["weight_bytes"]) + kv)


def add_args(p) -> None:
    p.add_argument("--contexts", default="",
                   help="comma list of context lengths (e.g. 512,2048,4096,8192): prefill and "
                        "batch-1 decode at each, every engine in a process of its own")
    p.add_argument("--context-output-len", type=int, default=64,
                   help="tokens decoded after each context prompt")


def parse(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if any(v < 1 for v in values):
        raise ValueError(f"--contexts must be positive token counts, got {text!r}")
    return sorted(set(values))


# positions past a context run's prompt and output that its engines are asked to hold
_MARGIN = 8


def fit(contexts: list[int], model_len: Optional[int], output_len: int) -> list[int]:
    """The prompt lengths to measure: each asked context, or, where its prompt and
    ``output_len`` tokens would not fit in the model's context length, the longest prompt that
    does (e.g. 8192 on an 8192-token model, 64 tokens out: 8120; the decode then ends at the
    model's last position). ``model_len`` None: no limit known."""
    if model_len is None:
        return contexts
    limit = model_len - output_len - _MARGIN
    if limit < 1:
        raise ValueError(f"--context-output-len {output_len} leaves no prompt in the model's "
                         f"context length {model_len}")
    return sorted({min(c, limit) for c in contexts})


def workload(contexts: list[int], vocab: int, output_len: int, seed: int) -> dict:
    """The spec fields of a context run (prompts keyed by their length, as JSON keys are)."""
    rng = random.Random(seed + 1)
    return {"contexts": contexts, "context_prompts": {str(c): random_ids(rng, c, vocab) for c in contexts},
            "context_output_len": output_len, "max_num_seqs": 1,
            "max_seq_len": max(contexts) + output_len + _MARGIN}


def attach(rows: list[dict], runs: dict[str, dict], bandwidth_gbps: float,
           like_for_like: dict, output_len: int) -> list[dict]:
    """Put each context run on its row; returns one table line per (row, context) with the
    floor (tokenmill rows) and tokenmill / peer ratios (the same pairing as the main table)."""
    by = {(r["engine"], r["precision"]): r for r in rows}
    for r in rows:
        run = runs.get(r["name"])
        if run is not None:
            r["contexts"] = run.get("contexts") or {}
            r["contexts_status"] = run.get("status")
            r["contexts_peak_rss_mb"] = round(run["peak_rss_bytes"] / 2**20, 1) if run.get("peak_rss_bytes") else None
    lines = []
    for r in rows:
        for c, m in sorted((r.get("contexts") or {}).items(), key=lambda kv: int(kv[0])):
            line = {"name": r["name"], "context": int(c), "status": r.get("contexts_status"),
                    "peak_rss_mb": r.get("contexts_peak_rss_mb"), **m}
            if r["engine"] == "tokenmill" and r.get("weight_bytes") and m.get("decode_tok_s"):
                step = decode_step_bytes(r, int(c) + output_len // 2)
                line["decode_x_floor"] = round(bandwidth_gbps * 1e9 / step / m["decode_tok_s"], 2)
            elif r["engine"] != "tokenmill":
                tm = _counterpart(by, r, like_for_like)
                theirs = (tm or {}).get("contexts", {}).get(c)
                if theirs and m.get("decode_tok_s") and m.get("prefill_tok_s"):
                    line["tokenmill_vs"] = {"against": tm["name"],
                                            "decode": round(theirs["decode_tok_s"] / m["decode_tok_s"], 2),
                                            "prefill": round(theirs["prefill_tok_s"] / m["prefill_tok_s"], 2)}
            lines.append(line)
    return lines


def _counterpart(by: dict, row: dict, like_for_like: dict) -> Optional[dict]:
    for p in like_for_like.get(row["precision"], (row["precision"],)):
        tm = by.get(("tokenmill", p))
        if tm and tm.get("contexts"):
            return tm
    return None


def goals(lines: list[dict]) -> list[dict]:
    """Per context: tokenmill decode vs llama.cpp on the same file (>= 1.5) and every
    tokenmill row's decode within 1.3x of its floor."""
    out = []
    for line in lines:
        vs = line.get("tokenmill_vs")
        if vs and line["name"].startswith("llama.cpp"):
            out.append((f"{vs['against']} decode at ctx {line['context']} vs {line['name']}",
                        vs["decode"], 1.5, ">="))
        if line.get("decode_x_floor") is not None:
            out.append((f"{line['name']} decode at ctx {line['context']}, multiple of its floor",
                        line["decode_x_floor"], 1.3, "<="))
    return [{"goal": g, "value": v, "target": f"{op} {t}",
             "met": v >= t if op == ">=" else v <= t} for g, v, t, op in out]
