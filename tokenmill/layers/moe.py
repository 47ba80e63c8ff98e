"""Mixture-of-Experts building blocks: top-k routing, fused expert computation, load counts.

``route``: softmax over the router logits, the top-k experts per token, weights optionally
renormalised to sum to 1 (Mixtral, Qwen3-MoE, OLMoE: yes; Qwen2-MoE: its config says).

``fused_experts``: instead of a Python loop over tokens (``experts_reference``, kept as the
test reference), the (token, expert) pairs are sorted by expert, so each active expert runs
one gate/up GEMM and one down GEMM over all its tokens; the outputs are scaled by the routing
weights and summed back per token with one ``index_add_``.

Weights are stacked per expert: ``w13`` [E, 2I, H] (gate rows then up rows, as the dense
MLP's merged gate_up), ``w2`` [E, H, I].
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64)."""
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act) -> torch.Tensor:
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(act(gate) * up, w2)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, act=F.silu) -> torch.Tensor:
    """x [T, H] -> [T, H]: sum over each token's k experts of weight * expert(x)."""
    num_tokens, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)              # (token, slot) pairs by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    token_of = order // k                                  # which token each sorted pair is
    scale = weights.reshape(-1)[order].to(x.dtype).unsqueeze(-1)
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_of[start:start + count]
        y = _expert_mlp(x.index_select(0, rows), w13[expert], w2[expert], act)
        out.index_add_(0, rows, y * scale[start:start + count])
        start += count
    return out


def experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, act=F.silu) -> torch.Tensor:
    """The per-token loop of the textbook MoE layer (slow; tests only)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            out[t] += weights[t, j].to(x.dtype) * _expert_mlp(x[t:t + 1], w13[e], w2[e], act)[0]
    return out


@dataclass
class ExpertLoad:
    """Tokens routed to each expert of each MoE layer since the last reset."""

    num_layers: int
    num_experts: int
    counts: list = field(default_factory=list)   # [layer][expert]

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [[0] * self.num_experts for _ in range(self.num_layers)]

    def record(self, layer: int, ids: torch.Tensor) -> None:
        per_expert = torch.bincount(ids.reshape(-1), minlength=self.num_experts).tolist()
        row = self.counts[layer]
        for e, n in enumerate(per_expert):
            row[e] += n

    def imbalance(self, layer: int) -> float:
        """max / mean tokens per expert (1.0 = perfectly even; 0.0 before any token)."""
        row = self.counts[layer]
        mean = sum(row) / len(row)
        return max(row) / mean if mean else 0.0
