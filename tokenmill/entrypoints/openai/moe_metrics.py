"""Mixture-of-Experts routing metrics for /metrics, under ``tokenmill:moe_*``.

Counters advance by the delta between engine snapshots (``layers.moe.ExpertLoad`` counts):
tokens routed to each expert of each MoE layer, (token, expert) pairs dropped (never, with no
capacity limit: exported so a dashboard can show it is zero), and with expert parallelism the
pairs each rank computed. Gauges carry each layer's imbalance (max / mean over its experts)
and the ranks' imbalance. Nothing is exported for a dense model.
"""
from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge

_P = "tokenmill:moe_"


class MoEMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry, self.model_name = registry, model_name
        self._built = False

    def _build(self) -> None:
        r, labels = self.registry, ["model_name"]
        self.tokens = Counter(_P + "expert_tokens", "Tokens routed to this expert of this MoE layer",
                              labels + ["layer", "expert"], registry=r)
        self.dropped = Counter(_P + "dropped_tokens", "Routed (token, expert) pairs dropped or rerouted",
                               labels, registry=r)
        self.rank_tokens = Counter(_P + "rank_tokens", "(token, expert) pairs computed by this "
                                   "expert-parallel rank", labels + ["rank"], registry=r)
        self.layer_imbalance = Gauge(_P + "layer_imbalance", "Max / mean tokens per expert of this "
                                     "layer, since start", labels + ["layer"], registry=r)
        self.rank_imbalance = Gauge(_P + "rank_imbalance", "Max / mean (token, expert) pairs per "
                                    "expert-parallel rank, since start", labels, registry=r)
        self._built = True

    def on_snapshot(self, load: Optional[dict], last: Optional[dict]) -> None:
        if load is None:
            return
        if not self._built:
            self._build()
        m = self.model_name
        last_counts = last["counts"] if last else None
        for layer, row in enumerate(load["counts"]):
            for expert, n in enumerate(row):
                delta = n - (last_counts[layer][expert] if last_counts else 0)
                if delta > 0:   # a reset (after warm-up) restarts the counts: no negative step
                    self.tokens.labels(m, str(layer), str(expert)).inc(delta)
            self.layer_imbalance.labels(m, str(layer)).set(load["imbalance"][layer])
        dropped = load["dropped"] - (last["dropped"] if last else 0)
        self.dropped.labels(m).inc(max(0, dropped))
        if "per_rank" in load:
            for rank, n in enumerate(load["per_rank"]):
                delta = n - (last["per_rank"][rank] if last and "per_rank" in last else 0)
                if delta > 0:
                    self.rank_tokens.labels(m, str(rank)).inc(delta)
            self.rank_imbalance.labels(m).set(load["rank_imbalance"])
