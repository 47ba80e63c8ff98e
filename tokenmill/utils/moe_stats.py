"""MoE routing figures as plain numbers (no torch): imbalance, and how the snapshots of
several data-parallel replicas add up. ``layers.moe.ExpertLoad.snapshot`` makes them."""
from __future__ import annotations

from typing import Iterable, Optional


def load_summary(counts: list, dropped: int, per_rank: Optional[list] = None) -> dict:
    """The figures of one reading: counts [layer][expert], the routed total, imbalance per
    layer; with expert parallelism the pairs each rank computed and their imbalance."""
    out = {"num_layers": len(counts), "num_experts": len(counts[0]) if counts else 0, "counts": counts,
           "routed": sum(map(sum, counts)), "dropped": dropped,
           "imbalance": [imbalance(row) for row in counts]}
    if per_rank is not None:
        out.update(per_rank=per_rank, rank_imbalance=imbalance(per_rank))
    return out


def merge_expert_loads(snapshots: list[dict]) -> Optional[dict]:
    """Snapshots of several replicas of one model: counts add up, ratios are recomputed."""
    if not snapshots:
        return None
    counts = [[sum(column) for column in zip(*rows)] for rows in zip(*(s["counts"] for s in snapshots))]
    per_rank = [sum(column) for column in zip(*(s["per_rank"] for s in snapshots))] \
        if "per_rank" in snapshots[0] else None
    return load_summary(counts, sum(s["dropped"] for s in snapshots), per_rank)


def imbalance(row: Iterable[int]) -> float:
    """max / mean tokens per expert (1.0 = perfectly even; 0.0 before any token)."""
    row = list(row)
    mean = sum(row) / len(row) if row else 0
    return max(row) / mean if mean else 0.0
