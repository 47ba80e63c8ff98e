"""MoE routing figures as plain numbers (no torch): imbalance, and how the snapshots of
several data-parallel replicas add up. ``layers.moe.ExpertLoad.snapshot`` makes them."""
from __future__ import annotations

from typing import Iterable, Optional


def merge_expert_loads(snapshots: list[dict]) -> Optional[dict]:
    """Snapshots of several replicas of one model: counts add up, ratios are recomputed."""
    if not snapshots:
        return None
    first = snapshots[0]
    counts = [[sum(s["counts"][layer][e] for s in snapshots) for e in range(first["num_experts"])]
              for layer in range(first["num_layers"])]
    out = {"num_layers": first["num_layers"], "num_experts": first["num_experts"], "counts": counts,
           "routed": sum(s["routed"] for s in snapshots), "dropped": sum(s["dropped"] for s in snapshots),
           "imbalance": [imbalance(row) for row in counts]}
    if "per_rank" in first:
        per_rank = [sum(s["per_rank"][r] for s in snapshots) for r in range(len(first["per_rank"]))]
        out.update(per_rank=per_rank, rank_imbalance=imbalance(per_rank))
    return out


def imbalance(row: Iterable[int]) -> float:
    """max / mean tokens per expert (1.0 = perfectly even; 0.0 before any token)."""
    row = list(row)
    mean = sum(row) / len(row) if row else 0
    return max(row) / mean if mean else 0.0
