"""Constrained-decoding metrics for /metrics, under ``tokenmill:structured_*`` and
``tokenmill:grammar_*``. Counters advance by the delta between engine snapshots
(``LLMEngine.structured_output_counters``; terms in tokenmill.structured.stats)."""
from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter

_P = "tokenmill:"
# snapshot key -> (metric name, help)
_COUNTERS = {
    "num_failed_requests": ("structured_failed_requests", "Constrained requests ended because a "
                            "token left their grammar"),
    "num_forced_draft_tokens": ("structured_forced_draft_tokens", "Grammar-forced tokens "
                                "verified as drafts"),
    "num_forced_accepted_tokens": ("structured_forced_accepted_tokens", "Grammar-forced drafts "
                                   "the model emitted"),
    "num_compiled": ("grammar_compiles", "Grammars compiled (compile-cache misses)"),
    "num_cache_hits": ("grammar_compile_cache_hits", "Constraints found in the compile cache"),
    "compile_seconds": ("grammar_compile_seconds", "Seconds spent compiling grammars"),
}


class StructuredOutputMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]
        self.model_name = model_name
        self.requests = Counter(_P + "structured_requests", "Requests with an output constraint",
                                labels + ["kind"], registry=registry)
        self.counters = {key: Counter(_P + name, text, labels, registry=registry)
                         for key, (name, text) in _COUNTERS.items()}

    def on_snapshot(self, now: Optional[dict], last: Optional[dict]) -> None:
        if now is None:
            return
        m, last = self.model_name, last or {}
        before = last.get("num_requests", {})
        for kind, n in now["num_requests"].items():
            if n > before.get(kind, 0):
                self.requests.labels(m, kind).inc(n - before.get(kind, 0))
        for key, counter in self.counters.items():
            delta = now[key] - last.get(key, 0)
            if delta > 0:
                counter.labels(m).inc(delta)
