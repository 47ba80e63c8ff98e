"""Prometheus metrics with vLLM's names under a ``tokenmill:`` prefix.

Each server gets its own CollectorRegistry (no process-global state, so tests can build several
apps). Latencies are observed from the event loop as clients see them; engine-side state
(running / waiting, KV usage, preemptions, token, prefix-cache, speculative decoding,
MoE routing and constrained-decoding counters) arrives as an EngineSnapshot from the engine thread after each step.
prometheus_client is thread-safe.
"""
from __future__ import annotations

import threading
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenmill.engine.async_engine import EngineSnapshot, RequestHandle
from tokenmill.entrypoints.openai.moe_metrics import MoEMetrics
from tokenmill.entrypoints.openai.spec_metrics import SpecDecodeMetrics
from tokenmill.entrypoints.openai.structured_metrics import StructuredOutputMetrics

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_P = "tokenmill:"
RECENT_SAMPLES = 2000   # latencies kept for the dashboard's percentiles


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name

        def hist(name, doc):
            return Histogram(_P + name, doc, labels, buckets=_LATENCY_BUCKETS, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Time from arrival to first token")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive tokens")
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to last token")
        self.queue_time = hist("request_queue_time_seconds", "Time waiting before first scheduled")
        self.running = Gauge(_P + "num_requests_running", "Requests in the running batch", labels, registry=r)
        self.waiting = Gauge(_P + "num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r)
        self.kv_usage = Gauge(_P + "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)", labels, registry=r)
        self.preemptions = Counter(_P + "num_preemptions", "Preempted requests", labels, registry=r)
        self.failed_steps = Counter(_P + "failed_steps", "Engine steps that raised (their requests were isolated)", labels, registry=r)
        self.prompt_tokens = Counter(_P + "prompt_tokens", "Prefill tokens processed", labels, registry=r)
        self.generation_tokens = Counter(_P + "generation_tokens", "Tokens generated", labels, registry=r)
        self.prefix_queries = Counter(_P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labels, registry=r)
        self.prefix_hits = Counter(_P + "prefix_cache_hits", "Prompt tokens served by the prefix cache", labels, registry=r)
        self.spec = SpecDecodeMetrics(r, model_name)     # tokenmill:spec_decode_*
        self.moe = MoEMetrics(r, model_name)              # tokenmill:moe_* (MoE models only)
        self.structured = StructuredOutputMetrics(r, model_name)   # structured_* / grammar_*
        self.request_success = Counter(_P + "request_success", "Finished requests", labels + ["finished_reason"], registry=r)
        self.request_errors = Counter(_P + "request_errors", "Requests answered with an HTTP error", labels + ["status"], registry=r)
        self._last = EngineSnapshot()
        self._lock = threading.Lock()
        # For the dashboard: recent latencies (bounded) and finish counts, as clients saw them.
        self.recent_ttft: deque = deque(maxlen=RECENT_SAMPLES)
        self.recent_itl: deque = deque(maxlen=RECENT_SAMPLES)
        self.num_finished = 0
        self.num_aborted = 0

    def on_engine_snapshot(self, snap: EngineSnapshot) -> None:
        """Called in the engine thread; counters advance by the delta since the last call."""
        m = self.model_name
        self.running.labels(m).set(snap.num_running)
        self.waiting.labels(m).set(snap.num_waiting)
        self.kv_usage.labels(m).set(snap.kv_cache_usage)
        for q in snap.new_queue_times:
            self.queue_time.labels(m).observe(q)
        with self._lock:
            last, self._last = self._last, snap
        self._advance(self.preemptions, snap.num_preemptions - last.num_preemptions)
        self._advance(self.failed_steps, snap.num_failed_steps - last.num_failed_steps)
        self._advance(self.prompt_tokens, snap.num_prompt_tokens - last.num_prompt_tokens)
        self._advance(self.generation_tokens, snap.num_generation_tokens - last.num_generation_tokens)
        self._advance(self.prefix_queries, snap.prefix_cache_queries - last.prefix_cache_queries)
        self._advance(self.prefix_hits, snap.prefix_cache_hits - last.prefix_cache_hits)
        self.spec.on_snapshot(snap.spec_decode, last.spec_decode, snap.new_spec_requests)
        self.moe.on_snapshot(snap.expert_load, last.expert_load)
        self.structured.on_snapshot(snap.structured_outputs, last.structured_outputs)

    def _advance(self, counter: Counter, delta: int) -> None:
        if delta > 0:
            counter.labels(self.model_name).inc(delta)

    def on_request_done(self, handle: RequestHandle, finish_reasons: list) -> None:
        m = self.model_name
        if handle.first_token_time is not None:
            self.ttft.labels(m).observe(handle.first_token_time - handle.arrival_time)
            self.e2e.labels(m).observe(handle.last_token_time - handle.arrival_time)
            self.recent_ttft.append(handle.first_token_time - handle.arrival_time)
        for gap in handle.inter_token_latencies:
            self.itl.labels(m).observe(gap)
        self.recent_itl.extend(handle.inter_token_latencies)
        for reason in finish_reasons:
            self.request_success.labels(m, reason or "abort").inc()
            self.num_finished += 1
            self.num_aborted += (reason or "abort") == "abort"

    def latency_percentiles(self) -> dict:
        """p50 / p90 / p99 in ms of the recent TTFTs and inter-token gaps (None when none)."""
        return {"ttft_ms": _percentiles_ms(self.recent_ttft), "itl_ms": _percentiles_ms(self.recent_itl)}

    def on_error(self, status: int) -> None:
        self.request_errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _percentiles_ms(values) -> "dict | None":
    if not values:
        return None
    ordered = sorted(values)
    def at(q: float) -> float:
        return round(1000.0 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)
    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99)}
