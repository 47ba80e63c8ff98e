"""`tokenmill bench serve`: a load client for any OpenAI-compatible server (tokenmill, vLLM,
llama.cpp's server ...). Sends random or ShareGPT prompts at a Poisson request rate or a fixed
concurrency, streams every answer, and reports TTFT / TPOT / ITL / E2E percentiles, output
tokens per second, goodput under stated SLOs, and errors, as JSON.

Only the standard library: the client must run next to any server without pulling in torch
or an HTTP stack (tqdm and matplotlib, for the progress bar and the chart, are used if
present). Each in-flight request is a thread (http.client streams chunked SSE).

Terms: TTFT = send -> first content chunk; ITL = gap between content chunks; TPOT = (E2E -
TTFT) / (output tokens - 1); goodput = requests per second that met every given SLO.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from http.client import HTTPConnection, HTTPSConnection
from typing import Optional

from tokenmill.bench.proc_memory import tree_peak_rss
from tokenmill.bench.report import Chart, add_output_args, progress, write_report

_WORDS = ("time year people way day man thing woman life child world school state family "
          "student group country problem hand part place case week company system program "
          "question work government number night point home water room mother area money "
          "story fact month lot right study book eye job word business issue side kind head "
          "house service friend father power hour game line end member law car city").split()


@dataclass
class RequestResult:
    ok: bool
    ttft: Optional[float] = None
    e2e: Optional[float] = None
    itls: list = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: Optional[str] = None

    @property
    def tpot(self) -> Optional[float]:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# -- prompts -------------------------------------------------------------------------------------
def random_prompts(num: int, input_len: int, output_len: int, seed: int) -> list[tuple[str, int]]:
    """(prompt, max_tokens): ``input_len`` random common words (~1 token each)."""
    rng = random.Random(seed)
    return [(" ".join(rng.choice(_WORDS) for _ in range(input_len)), output_len)
            for _ in range(num)]


def sharegpt_prompts(path: Optional[str], num: int, output_len: int, seed: int,
                     cache_dir: Optional[str] = None) -> list[tuple[str, int]]:
    """First user turn of ShareGPT conversations, from the file ``path``, else from the
    benchmark split of the ShareGPT V3 copy under ``cache_dir`` (``tokenmill.data.sharegpt``
    fetches it on first use; a cut-off last record is dropped). max_tokens ~ the length of
    the answer given in the data (4 characters a token), capped at ``output_len``. As in the
    other benches, the pool is the first max(200, 20 * num) conversations, shuffled by
    ``seed``."""
    from tokenmill.data.sharegpt import iter_conversations, sharegpt_path
    split = None if path else "benchmark"
    convs = iter_conversations(path or sharegpt_path(cache_dir), split)
    pairs = []
    for turns in itertools.islice(convs, max(200, 20 * num)):
        if turns[0]["content"] and turns[1]["content"]:
            answer_tokens = max(4, min(output_len, len(turns[1]["content"]) // 4))
            pairs.append((turns[0]["content"], answer_tokens))
    if not pairs:
        raise ValueError(f"{path or 'ShareGPT'}: no conversations with a prompt and an answer")
    random.Random(seed).shuffle(pairs)
    return [pairs[i % len(pairs)] for i in range(num)]


# -- one request ----------------------------------------------------------------------------------
def _connection(base_url: str, timeout: float):
    u = urllib.parse.urlsplit(base_url)
    cls = HTTPSConnection if u.scheme == "https" else HTTPConnection
    return cls(u.hostname, u.port, timeout=timeout), u.path.rstrip("/")


def _body(args, prompt: str, max_tokens: int) -> dict:
    body = {"model": args.model_name, "max_tokens": max_tokens, "stream": True,
            "temperature": args.temperature, "ignore_eos": args.ignore_eos,
            "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _chunk_text(event: dict) -> str:
    texts = []
    for choice in event.get("choices") or []:
        delta = choice.get("delta")
        texts.append((delta or {}).get("content") or "" if delta is not None
                     else choice.get("text") or "")
    return "".join(texts)


def send_one(args, prompt: str, max_tokens: int) -> RequestResult:
    path = "/chat/completions" if args.endpoint == "chat" else "/completions"
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    result = RequestResult(ok=False)
    start = time.perf_counter()
    conn, base = _connection(args.base_url, args.timeout)
    try:
        conn.request("POST", base + path, json.dumps(_body(args, prompt, max_tokens)), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            result.error = f"HTTP {resp.status}"
            resp.read()
            return result
        _read_stream(resp, start, result)
    except (OSError, ValueError) as e:
        result.error = type(e).__name__
    finally:
        conn.close()
    return result


def _read_stream(resp, start: float, result: RequestResult) -> None:
    last = None
    num_chunks = 0
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            result.ok = result.error is None and result.ttft is not None
            break
        event = json.loads(data)
        if "error" in event:
            result.error = f"stream error: {event['error'].get('message', '')[:80]}"
            continue
        if event.get("usage"):
            result.output_tokens = event["usage"].get("completion_tokens", 0)
            result.prompt_tokens = event["usage"].get("prompt_tokens", 0)
        if _chunk_text(event):
            now = time.perf_counter()
            if result.ttft is None:
                result.ttft = now - start
            else:
                result.itls.append(now - last)
            last = now
            num_chunks += 1
    result.e2e = time.perf_counter() - start
    if not result.output_tokens:   # server sent no usage: one chunk ~ one token
        result.output_tokens = num_chunks
    if result.ttft is None and result.error is None:
        result.error = "no content streamed"


# -- the run -------------------------------------------------------------------------------------
def run_load(args, prompts: list[tuple[str, int]], bar=None) -> tuple[list[RequestResult], float]:
    """Send every prompt: Poisson arrivals at ``request_rate`` (inf = all at once), never more
    than ``max_concurrency`` in flight. Returns results and the wall time."""
    rng = random.Random(args.seed)
    limit = threading.BoundedSemaphore(args.max_concurrency or len(prompts))
    results: list[Optional[RequestResult]] = [None] * len(prompts)

    def task(i: int, prompt: str, max_tokens: int) -> None:
        try:
            results[i] = send_one(args, prompt, max_tokens)
        finally:
            limit.release()
            if bar is not None:
                bar.update()

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=min(len(prompts), args.max_concurrency or 512)) as pool:
        for i, (prompt, max_tokens) in enumerate(prompts):
            limit.acquire()
            pool.submit(task, i, prompt, max_tokens)
            if args.request_rate != float("inf"):
                time.sleep(rng.expovariate(args.request_rate))
    return [r for r in results if r is not None], time.perf_counter() - start


def _percentiles(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def pct(p: float) -> float:
        k = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
        return round(ordered[k] * scale, 2)
    return {"mean": round(statistics.fmean(values) * scale, 2), "p50": pct(50), "p90": pct(90),
            "p99": pct(99)}


def _meets_slo(r: RequestResult, args) -> bool:
    checks = ((args.slo_ttft_ms, r.ttft), (args.slo_tpot_ms, r.tpot), (args.slo_e2e_ms, r.e2e))
    return all(limit is None or (value is not None and value * 1000 <= limit)
               for limit, value in checks)


def summarize(results: list[RequestResult], duration: float, args) -> dict:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    output_tokens = sum(r.output_tokens for r in ok)
    good = [r for r in ok if _meets_slo(r, args)]
    return {
        "base_url": args.base_url, "endpoint": args.endpoint, "model": args.model_name,
        "dataset": args.dataset, "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency, "num_requests": len(results),
        "completed": len(ok), "failed": len(results) - len(ok), "errors": errors,
        "duration_s": round(duration, 3),
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": output_tokens,
        "request_throughput_rps": round(len(ok) / duration, 3),
        "output_throughput_tok_s": round(output_tokens / duration, 2),
        "slo_ms": {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms, "e2e": args.slo_e2e_ms},
        "goodput_rps": round(len(good) / duration, 3),
        "ttft_ms": _percentiles([r.ttft for r in ok]),
        "tpot_ms": _percentiles([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _percentiles([gap for r in ok for gap in r.itls]),
        "e2e_ms": _percentiles([r.e2e for r in ok]),
        "client_load_avg_1m": round(os.getloadavg()[0], 2),
    }


def run(args) -> int:
    if args.dataset == "sharegpt":
        prompts = sharegpt_prompts(args.dataset_path, args.num_prompts, args.output_len, args.seed)
    else:
        prompts = random_prompts(args.num_prompts, args.input_len, args.output_len, args.seed)
    if args.warmup:
        send_one(args, prompts[0][0], 4)
    with progress(len(prompts), "bench serve", getattr(args, "progress", True)) as bar:
        results, duration = run_load(args, prompts, bar)
    summary = summarize(results, duration, args)
    if getattr(args, "server_pid", None):   # a local server: its memory, child processes too
        peak, children = tree_peak_rss(args.server_pid)
        summary["server_peak_rss_mb"] = round(peak / 2**20, 1) if peak else None
        summary["server_processes"] = 1 + children if peak else 0
    print(json.dumps(summary, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"summary": summary, "requests": [asdict(r) for r in results]}, f)
    if getattr(args, "output_dir", None):
        rows = [{"metric": m, **summary[m]} for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")]
        paths = write_report("serve", {"bench": "serve", **summary}, args.output_dir, rows,
                             Chart("metric", ("p50", "p90", "p99"),
                                   title=f"serve, {args.model_name} @ {args.base_url}"))
        print("wrote " + ", ".join(paths.values()), file=sys.stderr)
    return 0 if summary["completed"] else 1


def add_bench_serve_parser(bench_subparsers) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser("serve", help="load-test an OpenAI-compatible server")
    _add_args(p)
    add_output_args(p)
    p.set_defaults(func=run)
    return p


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                   help="OpenAI-compatible base URL (…/v1)")
    p.add_argument("--model-name", default="smollm2-135m", help="the 'model' field sent")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", choices=["random", "sharegpt"], default="random")
    p.add_argument("--dataset-path", default=None,
                   help="a ShareGPT-format JSON file (default: the cached ShareGPT V3 copy, "
                        "fetched on first use)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128, help="random: words per prompt")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens (ShareGPT: cap)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight (fixed-concurrency mode)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly max_tokens (servers that know the flag)")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-e2e-ms", type=float, default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--output-json", default=None, help="write summary + per-request results")
    p.add_argument("--server-pid", type=int, default=None,
                   help="a local server's process id: report its peak RSS (with the processes "
                        "it started, such as vLLM's engine core) after the load")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill bench serve", description=__doc__)
    _add_args(parser)
    add_output_args(parser, default_dir=None)   # standalone: report files only when asked
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
