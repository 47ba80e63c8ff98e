"""Hot-expert replication for expert parallelism (beyond the peers' defaults).

With experts sharded whole over the ranks, a popular expert makes its rank the slowest of
every step. Every ``interval`` engine steps the balancer reads the routing counts of the
window since its last look, picks each MoE layer's ``k`` hottest experts and, when the choice
changed, has every rank hold copies of them; a replicated expert's tokens are then split over
all ranks (``layers.moe.SparseMoE.set_replicas``). Outputs do not change: the same experts
compute the same tokens, only on other ranks.
"""
from __future__ import annotations

from typing import Optional


class ExpertBalancer:
    def __init__(self, num_hot: int, interval: int) -> None:
        self.num_hot, self.interval = num_hot, interval
        self.steps = 0
        self.last_counts: Optional[list] = None
        self.plan: Optional[list] = None   # per MoE layer: the replicated expert ids

    def after_step(self, engine) -> None:
        self.steps += 1
        if self.steps % self.interval:
            return
        load = engine.expert_load()
        if load is None:
            return
        plan = self.choose(load["counts"])
        if plan is not None and plan != self.plan:
            engine.executor.call_all("replicate_experts", plan)
            self.plan = plan

    def choose(self, counts: list) -> Optional[list]:
        """Each layer's ``num_hot`` experts with the most tokens since the last call (all
        counts after a reset); None when nothing was routed."""
        last = self.last_counts
        self.last_counts = counts
        if last is None or any(n < m for row, old in zip(counts, last) for n, m in zip(row, old)):
            window = counts
        else:
            window = [[n - m for n, m in zip(row, old)] for row, old in zip(counts, last)]
        if not any(map(any, window)):
            return None
        return [sorted(sorted(range(len(row)), key=lambda e: (-row[e], e))[:self.num_hot]) for row in window]
