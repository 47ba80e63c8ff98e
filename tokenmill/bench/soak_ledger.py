"""The soak's ledger: every outcome the client saw, and the checks that span requests --
twins agree, the server's counters equal the ledger's, the KV pool is empty at idle, the
server's memory stays flat (standard library only)."""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from typing import Optional

from tokenmill.bench.soak_client import Outcome, SoakRequest

_SAMPLE = re.compile(r'^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$')


def parse_metrics(text: str) -> dict:
    """Prometheus text -> {(name, labels string): value}."""
    values = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m and not line.startswith("#"):
            values[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return values


def metric_sum(metrics: dict, name: str, label: Optional[str] = None) -> float:
    """Sum of ``name``'s samples, only those whose labels contain ``label`` if given."""
    return sum(v for (n, labels), v in metrics.items()
               if n == name and (label is None or label in labels))


@dataclass
class Ledger:
    requests: dict = field(default_factory=dict)   # index -> SoakRequest
    outcomes: dict = field(default_factory=dict)   # index -> Outcome
    violations: list = field(default_factory=list)

    def record(self, req: SoakRequest, out: Outcome) -> None:
        if out.index in self.outcomes:
            self.violations.append(f"request {out.index} ended twice")
        self.requests[req.index] = req
        self.outcomes[out.index] = out
        self.violations += [f"request {out.index} ({_describe(req)}): {v}" for v in out.violations]

    def by_kind(self) -> dict:
        kinds: dict[str, int] = {}
        for out in self.outcomes.values():
            kinds[out.kind] = kinds.get(out.kind, 0) + 1
        return kinds

    def check_twins(self) -> int:
        """Streamed == whole for the same seed; returns how many pairs were compared."""
        compared = 0
        for index, req in self.requests.items():
            if req.twin_of is None:
                continue
            a, b = self.outcomes.get(req.twin_of), self.outcomes[index]
            if a is None or a.kind != "completed" or b.kind != "completed":
                continue
            compared += 1
            if (a.texts, a.finish_reasons) != (b.texts, b.finish_reasons):
                self.violations.append(
                    f"twins {req.twin_of} / {index} ({_describe(req)}) differ: "
                    f"{a.texts!r} {a.finish_reasons} vs {b.texts!r} {b.finish_reasons}")
        return compared

    def check_counters(self, before: dict, after: dict) -> dict:
        """The server's finished-sample and HTTP-error counters moved exactly as the ledger
        says. An aborted request may have finished in the server before the hang-up was
        seen, so its samples may count as stop / length instead of abort."""
        def delta(name, label=None):
            return metric_sum(after, name, label) - metric_sum(before, name, label)
        seen = {r: 0 for r in ("stop", "length", "abort", "error")}
        aborted = 0
        for out in self.outcomes.values():
            if out.kind == "completed":
                for reason in out.finish_reasons.values():
                    seen[reason] = seen.get(reason, 0) + 1
            elif out.kind == "aborted":
                aborted += out.num_samples
        server = {r: delta("tokenmill:request_success_total", f'finished_reason="{r}"') for r in seen}
        total_client = sum(seen.values()) + aborted
        if sum(server.values()) != total_client:
            self.violations.append(f"server counted {sum(server.values()):.0f} finished samples, "
                                   f"the ledger {total_client}")
        for reason in ("stop", "length"):
            if not seen[reason] <= server[reason] <= seen[reason] + aborted:
                self.violations.append(f"server {reason}={server[reason]:.0f} vs ledger "
                                       f"{seen[reason]} (+ up to {aborted} aborted)")
        if server["abort"] > aborted or server["error"]:
            self.violations.append(f"server abort={server['abort']:.0f} error={server['error']:.0f}, "
                                   f"ledger aborted {aborted}")
        kinds = self.by_kind()
        for status, kind in (("400", "bad_input"), ("503", "rejected")):
            got = delta("tokenmill:request_errors_total", f'status="{status}"')
            if got != kinds.get(kind, 0):
                self.violations.append(f"server counted {got:.0f} HTTP {status}, the ledger "
                                       f"{kinds.get(kind, 0)}")
        return {"server_finished": server, "ledger_finished": seen, "ledger_aborted_samples": aborted}

    def check_idle(self, metrics: dict) -> dict:
        idle = {name: metric_sum(metrics, "tokenmill:" + name)
                for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")}
        if any(idle.values()):
            self.violations.append(f"not idle after the run: {idle}")
        return idle

    def latencies(self) -> dict:
        done = [o for o in self.outcomes.values() if o.kind == "completed"]
        return {"e2e_ms": percentiles([o.e2e_s for o in done]),
                "ttft_ms": percentiles([o.ttft_s for o in done if o.ttft_s is not None])}


def rss_slope_mb_per_1000(samples: list[tuple[int, int]]) -> Optional[float]:
    """Least-squares slope of (requests ended, RSS bytes) in MB per 1,000 requests over the
    second half of the run; None with too few samples. The first half is warm-up: caches
    that fill once and stay bounded grow RSS there (oneDNN's primitive cache keeps up to
    1,024 kernels, one per new GEMM shape, i.e. per new prefill length)."""
    tail = samples[len(samples) // 2:]
    xs = [float(x) for x, _ in tail]
    if len(tail) < 4 or max(xs) - min(xs) < 20:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(y for _, y in tail)
    num = sum((x - mx) * (y - my) for x, (_, y) in zip(xs, tail))
    den = sum((x - mx) ** 2 for x in xs)
    return round(num / den * 1000 / 2**20, 3)


def percentiles(values: list[float]) -> Optional[dict]:
    if not values:
        return None
    ordered = sorted(values)
    def at(q: float) -> float:
        return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)
    return {"p50": at(0.5), "p99": at(0.99), "max": round(1000 * ordered[-1], 1)}


def _describe(req: SoakRequest) -> str:
    parts = [req.endpoint, "stream" if req.stream else "whole", f"n={req.body.get('n', 1)}",
             f"T={req.body.get('temperature')}"]
    if req.twin_of is not None:
        parts.append(f"twin of {req.twin_of}")
    return " ".join(parts)
