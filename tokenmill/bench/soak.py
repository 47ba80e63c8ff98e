"""`tokenmill bench soak`: sustained mixed load on a server started on loopback, with a client
ledger that checks the engine's promises (tokenmill.bench.soak_ledger) instead of timing it.

Poisson arrivals of streamed and whole, chat and completions requests, n = 1 or 2, seeds,
stop strings, JSON-schema outputs, shared prefixes, ~3% invalid on purpose and a fraction
hung up on mid-way, against a KV pool small enough to force preemption. The run is bounded
by ``--duration`` and ``--max-requests``. Then, at idle, the server's counters must equal
the ledger's, no KV block may be in use, and SIGTERM must stop the server with status 0.
Exit status 1 when any check failed.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from tokenmill.bench.common import emit, machine_info
from tokenmill.bench.report import add_output_args
from tokenmill.bench.soak_client import RequestPlan, send
from tokenmill.bench.soak_ledger import Ledger, metric_sum, parse_metrics, rss_slope_mb_per_1000


def parse_duration(text: str) -> float:
    """Seconds from '90', '90s', '10m' or '1h'."""
    units = {"s": 1, "m": 60, "h": 3600}
    text = str(text).strip()
    scale = units.get(text[-1:], None)
    try:
        value = float(text[:-1] if scale else text) * (scale or 1)
    except ValueError:
        raise ValueError(f"--duration: expected seconds or a number with s/m/h, got {text!r}") from None
    if value <= 0:
        raise ValueError(f"--duration must be positive, got {text!r}")
    return value


def add_parser(sub) -> None:
    p = sub.add_parser("soak", help="sustained mixed load with a client ledger of every request")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--duration", default="10m", help="e.g. 60s, 10m")
    p.add_argument("--max-requests", type=int, default=100_000)
    p.add_argument("--request-rate", type=float, default=2.0, help="Poisson arrivals per second")
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--abort-fraction", type=float, default=0.25)
    p.add_argument("--num-kv-blocks", type=int, default=24, help="small, to force preemption")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--num-threads", type=int, default=None, help="the server's torch threads")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request seconds")
    p.add_argument("--max-rss-slope-mb", type=float, default=16.0,
                   help="server RSS growth per 1,000 requests above which the run fails")
    p.add_argument("--onednn-primitive-cache", type=int, default=None, metavar="N",
                   help="cap oneDNN's kernel cache in the server (ONEDNN_PRIMITIVE_CACHE_CAPACITY "
                        "of its process): its bounded warm-up (1,024 kernels, one per new GEMM "
                        "shape) otherwise dominates RSS growth for thousands of requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    add_output_args(p)
    p.set_defaults(func=run)


class Server:
    """`tokenmill serve` in a child process on a free loopback port."""

    def __init__(self, args) -> None:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--model", args.model,
               "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", "soak",
               "--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs", str(args.max_num_seqs),
               "--disable-web-ui", "--log-level", "warning", "--drain-timeout", "30"]
        if args.num_threads:
            cmd += ["--num-threads", str(args.num_threads)]
        env = dict(os.environ)
        if args.onednn_primitive_cache is not None:   # read by oneDNN in the child process
            env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(args.onednn_primitive_cache)
        self.log = open(os.devnull, "w") if args.quiet_server else None
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=self.log, env=env)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode}")
            try:
                if urllib.request.urlopen(self.url + "/health", timeout=2).status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the server did not become healthy")

    def metrics(self) -> dict:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return parse_metrics(r.read().decode())

    def rss_bytes(self) -> int:
        return sum(_rss(pid) for pid in [self.proc.pid, *_children(self.proc.pid)])

    def stop(self, timeout: float = 60.0) -> Optional[int]:
        """SIGTERM (a drain) -> exit status, None if it had to be killed."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None
        finally:
            if self.log is not None:
                self.log.close()


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(p) for p in f.read().split()]
    except OSError:
        return []
    return kids + [g for k in kids for g in _children(k)]


def drive(args, server: Server, ledger: Ledger, duration: float) -> list[tuple[int, int]]:
    """Send the plan's requests until the time or count runs out; returns RSS samples
    (requests ended, bytes) taken every second."""
    plan = RequestPlan(args.seed, args.abort_fraction, "soak")
    arrivals = random.Random(args.seed + 1)
    slots = threading.BoundedSemaphore(args.max_concurrency)
    lock, samples, running = threading.Lock(), [], threading.Event()
    running.set()

    def one(req) -> None:
        try:
            out = send(server.url + "/v1", req, args.timeout)
            with lock:
                ledger.record(req, out)
        finally:
            slots.release()

    def sample_rss() -> None:
        while running.is_set():
            samples.append((len(ledger.outcomes), server.rss_bytes()))
            time.sleep(1.0)

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    deadline = time.monotonic() + duration
    with ThreadPoolExecutor(args.max_concurrency) as pool:
        while time.monotonic() < deadline and plan.count < args.max_requests:
            slots.acquire()
            pool.submit(one, plan.next())
            time.sleep(arrivals.expovariate(args.request_rate))
    running.clear()
    sampler.join()
    samples.append((len(ledger.outcomes), server.rss_bytes()))
    return samples


def wait_idle(server: Server, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        busy = sum(metric_sum(metrics, "tokenmill:" + n)
                   for n in ("num_requests_running", "num_requests_waiting"))
        if not busy or time.monotonic() > deadline:
            return metrics
        time.sleep(0.5)


def run(args) -> int:
    duration = parse_duration(args.duration)
    args.quiet_server = not getattr(args, "verbose_server", False)
    server = Server(args)
    ledger = Ledger()
    try:
        server.wait_ready()
        before = server.metrics()
        start = time.monotonic()
        samples = drive(args, server, ledger, duration)
        wall = time.monotonic() - start
        after = wait_idle(server)
    except BaseException:
        server.stop(10)
        raise
    exit_status = server.stop()
    result = summarize(args, ledger, before, after, samples, wall, exit_status)
    emit(result, args.json, args.output_dir, rows=[{"outcome": k, "requests": v}
                                                   for k, v in result["requests_by_outcome"].items()],
         name="soak")
    return 1 if result["num_violations"] else 0


def summarize(args, ledger: Ledger, before: dict, after: dict, samples: list, wall: float,
              exit_status: Optional[int]) -> dict:
    counters = ledger.check_counters(before, after)
    idle = ledger.check_idle(after)
    twins = ledger.check_twins()
    preemptions = (metric_sum(after, "tokenmill:num_preemptions_total")
                   - metric_sum(before, "tokenmill:num_preemptions_total"))
    if not preemptions:
        ledger.violations.append("no preemption happened: the KV pool was not small enough")
    slope = rss_slope_mb_per_1000(samples)
    if slope is not None and slope > args.max_rss_slope_mb:
        ledger.violations.append(f"server RSS grew {slope} MB per 1,000 requests")
    if exit_status != 0:
        ledger.violations.append(f"SIGTERM at idle: exit status {exit_status} (None: killed)")
    return {
        "bench": "soak", "model": args.model, "duration_s": round(wall, 1),
        "requests": len(ledger.outcomes), "requests_by_outcome": ledger.by_kind(),
        "request_rate": args.request_rate, "num_kv_blocks": args.num_kv_blocks,
        "onednn_primitive_cache": args.onednn_primitive_cache,
        "twins_compared": twins, "preemptions": preemptions,
        "failed_steps": metric_sum(after, "tokenmill:failed_steps_total")
        - metric_sum(before, "tokenmill:failed_steps_total"),
        "latency": ledger.latencies(), "counters": counters, "idle": idle,
        "rss_mb": {"first": round(samples[0][1] / 2**20, 1), "last": round(samples[-1][1] / 2**20, 1),
                   "max": round(max(s[1] for s in samples) / 2**20, 1),
                   "slope_per_1000_requests": slope,
                   # (requests ended, MB) at ~20 points, to see where growth happens
                   "trace": [(n, round(b / 2**20, 1)) for n, b in samples[::max(1, len(samples) // 20)]]},
        "server_exit_status": exit_status,
        "num_violations": len(ledger.violations), "violations": ledger.violations[:50],
        "machine": machine_info(),
    }
