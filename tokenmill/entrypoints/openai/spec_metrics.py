"""Speculative decoding metrics for /metrics, under ``tokenmill:spec_decode_*`` (terms defined
in tokenmill.spec.metrics).

Counters follow vLLM (num_drafts, num_draft_tokens, num_accepted_tokens, accepted tokens per
draft position) plus total draft / verify seconds; they advance by the delta between engine
snapshots. Gauges carry the running mean acceptance length and estimated speedup; histograms
observe each finished request's acceptance length, estimated speedup, draft and verify time.
Counters are exported at 0 from the start, so dashboards need no change when speculation is on.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_P = "tokenmill:spec_decode_"
_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                 40.0, 80.0, 160.0)
_TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0, 33.0)
_SPEEDUP_BUCKETS = (0.5, 0.75, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0)
_COUNTS = {"num_drafts": "Drafts verified (one request's k >= 1 draft tokens in one step)",
           "num_draft_tokens": "Draft tokens verified",
           "num_accepted_tokens": "Draft tokens accepted by the target"}
_TIMES = {"draft_time_s": ("draft_time_seconds", "Seconds spent proposing drafts"),
          "verify_time_s": ("verify_time_seconds",
                            "Seconds of steps that verified drafts (target forward + rejection sampling)")}


class SpecDecodeMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        r, labels, self.model_name = registry, ["model_name"], model_name
        self.counts = {key: Counter(_P + key, doc, labels, registry=r) for key, doc in _COUNTS.items()}
        self.times = {key: Counter(_P + name, doc, labels, registry=r)
                      for key, (name, doc) in _TIMES.items()}
        self.per_pos = Counter(_P + "num_accepted_tokens_per_pos",
                               "Drafts whose token at this position was accepted",
                               labels + ["position"], registry=r)
        self.tau = Gauge(_P + "mean_acceptance_length",
                         "Tokens per target forward for a drafted request (bonus included), since start",
                         labels, registry=r)
        self.speedup = Gauge(_P + "estimated_speedup",
                             "Plain-decoding time for the emitted tokens / draft + verify time, since start",
                             labels, registry=r)
        self.req_tau = Histogram(_P + "request_acceptance_length", "Per finished request: mean acceptance length",
                                 labels, buckets=_TAU_BUCKETS, registry=r)
        self.req_speedup = Histogram(_P + "request_estimated_speedup", "Per finished request: estimated speedup",
                                     labels, buckets=_SPEEDUP_BUCKETS, registry=r)
        self.req_draft = Histogram(_P + "request_draft_time_seconds", "Per finished request: drafting seconds",
                                   labels, buckets=_TIME_BUCKETS, registry=r)
        self.req_verify = Histogram(_P + "request_verify_time_seconds",
                                    "Per finished request: seconds of steps that verified its drafts",
                                    labels, buckets=_TIME_BUCKETS, registry=r)
        for metric in (*self.counts.values(), *self.times.values()):
            metric.labels(model_name)

    def on_snapshot(self, spec: dict | None, last: dict | None, new_requests) -> None:
        """spec / last: cumulative counters now and at the previous snapshot (engine thread)."""
        if spec is None:
            return
        m, last = self.model_name, last or {}
        for key, counter in (*self.counts.items(), *self.times.items()):
            delta = spec[key] - last.get(key, 0)
            if delta > 0:
                counter.labels(m).inc(delta)
        before = last.get("num_accepted_tokens_per_pos") or []
        for pos, count in enumerate(spec["num_accepted_tokens_per_pos"]):
            delta = count - (before[pos] if pos < len(before) else 0)
            if delta > 0:
                self.per_pos.labels(m, str(pos)).inc(delta)
        self.tau.labels(m).set(spec["mean_acceptance_length"])
        self.speedup.labels(m).set(spec["estimated_speedup"])
        for req in new_requests:
            if req.num_drafts:
                self.req_tau.labels(m).observe(req.mean_acceptance_length)
                self.req_draft.labels(m).observe(req.draft_time)
                self.req_verify.labels(m).observe(req.verify_time)
            if req.estimated_speedup is not None:
                self.req_speedup.labels(m).observe(req.estimated_speedup)
