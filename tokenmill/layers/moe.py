"""Mixture-of-Experts: top-k routing, fused expert computation, expert parallelism, load counts.

``route``: softmax over the router logits, the top-k experts per token, weights optionally
renormalised to sum to 1 (Mixtral: always; Qwen2-MoE, Qwen3-MoE, OLMoE: ``norm_topk_prob``).

``combine_experts``: instead of a Python loop over tokens (``experts_reference``, kept as the
test reference), the (token, slot) pairs are sorted by expert, so each active expert runs one
gate/up GEMM and one down GEMM over all of its tokens; the outputs are scaled by the routing
weights and summed back per token.

``SparseMoE`` is the layer: a float router (never quantized: a few hundred rows decide which
weights run at all), experts as ordinary ``MergedLinear`` / ``Linear`` pairs (so int8, int4,
FP8 and packed GGUF strategies apply to them unchanged), Qwen2-MoE's sigmoid-gated shared
expert. Parallel layouts over the tensor-parallel group:
- tensor parallel (default): every rank holds every expert's slice of FFN columns;
- expert parallel (``expert_parallel=True``): every rank holds whole experts, a contiguous
  share of them. Hidden states are replicated across the group after attention, so dispatch
  needs no communication: each rank runs the tokens routed to its own experts.
Either way the rank's partial sum (its experts or its columns, plus its shared-expert columns)
is combined by one all-reduce per layer, the same collective a dense row-parallel FFN does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.parallel_state import SINGLE, TPGroup, split_evenly
from tokenmill.utils.moe_stats import load_summary


@dataclass(frozen=True)
class MoEArgs:
    """What a checkpoint's config says about its expert layers."""
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    renormalize: bool
    shared_expert_intermediate_size: int = 0   # Qwen2-MoE: one always-on expert, sigmoid-gated
    sparse_layers: tuple = ()                  # per layer: experts (True) or a dense MLP

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"an MoE model needs at least one expert, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"experts per token must be in [1, {self.num_experts}], got {self.top_k}")

    def is_sparse(self, layer: int) -> bool:
        return self.sparse_layers[layer] if self.sparse_layers else True


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


def combine_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    run_expert: Callable[[int, torch.Tensor], torch.Tensor],
                    counts: list[int], shares: Optional[dict] = None) -> torch.Tensor:
    """x [T, H] -> [T, H]: sum over each token's k experts of weight * run_expert(e, rows).
    ``counts``: tokens per expert (``bincount`` of ``ids``). ``shares`` (expert parallel):
    expert -> (i, n), this rank runs every n-th of the expert's tokens from the i-th (an expert
    replicated on n ranks splits its tokens; (0, 1): all of them); experts absent from it are
    another rank's share of the sum."""
    k = ids.shape[1]
    if x.shape[0] == 1:
        # A decode step of one sequence: the sort would cost more than it saves.
        out = torch.zeros_like(x)
        scale = weights[0].to(x.dtype)
        for j, e in enumerate(ids[0].tolist()):
            if shares is None or shares.get(e, (1,))[0] == 0:   # a single token: the first holder
                out.addcmul_(run_expert(e, x), scale[j])
        return out
    order = torch.argsort(ids.reshape(-1), stable=True)   # (token, slot) pairs by expert
    token_of = order // k
    # Expert outputs land in sorted order, go back to (token, slot) order with one copy, and
    # each token's k rows are weighted and summed: no scatter-add, the same sum every run.
    by_expert = x.new_empty(ids.numel(), x.shape[1]) if shares is None else x.new_zeros(ids.numel(), x.shape[1])
    start = 0
    for expert, count in enumerate(counts):
        share = (0, 1) if shares is None else shares.get(expert)
        if count and share is not None and share[0] < count:
            rows = slice(start + share[0], start + count, share[1])
            by_expert[rows] = run_expert(expert, x.index_select(0, token_of[rows]))
        start += count
    by_slot = torch.empty_like(by_expert).index_copy_(0, order, by_expert)
    return torch.einsum("tkh,tk->th", by_slot.view(-1, k, x.shape[1]), weights.to(x.dtype))


def _expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act) -> torch.Tensor:
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(act(gate) * up, w2)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, act=F.silu) -> torch.Tensor:
    """``combine_experts`` over stacked float weights ``w13`` [E, 2I, H] (gate rows then up
    rows) and ``w2`` [E, H, I] (benchmarks and tests)."""
    counts = torch.bincount(ids.reshape(-1), minlength=w13.shape[0]).tolist()
    return combine_experts(x, weights, ids, lambda e, rows: _expert_mlp(rows, w13[e], w2[e], act), counts)


def experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, act=F.silu) -> torch.Tensor:
    """The per-token loop of the textbook MoE layer (slow; tests only)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            out[t] += weights[t, j].to(x.dtype) * _expert_mlp(x[t:t + 1], w13[e], w2[e], act)[0]
    return out


class ExpertLoad:
    """Tokens routed to each expert of each MoE layer since the last reset, kept as one int64
    tensor so recording a step is a single in-place add per layer; with expert parallelism
    also the (token, expert) pairs each rank computed. Nothing is ever dropped or rerouted
    (no capacity limit), and ``dropped`` counts it to say so."""

    def __init__(self, num_layers: int, num_experts: int, num_ranks: Optional[int] = None) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.int64)
        self.rank_pairs = torch.zeros(num_ranks, dtype=torch.int64) if num_ranks else None
        self.dropped = 0

    def record(self, layer: int, per_expert: torch.Tensor) -> None:
        self.counts[layer].add_(per_expert)

    def reset(self) -> None:
        self.counts.zero_()
        if self.rank_pairs is not None:
            self.rank_pairs.zero_()
        self.dropped = 0

    def snapshot(self) -> dict:
        """Plain numbers: counts per layer and expert, the routed total, imbalance (max / mean)
        per layer; with expert parallelism the pairs each rank computed and their imbalance."""
        return load_summary(self.counts.tolist(), self.dropped,
                            None if self.rank_pairs is None else self.rank_pairs.tolist())


def expert_shards(num_experts: int, size: int) -> list[range]:
    """Expert ids each rank of an expert-parallel group holds (contiguous, equal shares)."""
    per_rank = split_evenly(num_experts, size, "experts")
    return [range(r * per_rank, (r + 1) * per_rank) for r in range(size)]


class Router(nn.Module):
    """logits = x W^T, W [num_experts, hidden]: replicated on every rank, kept float."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SharedExpertGate(Router):
    """Qwen2-MoE: one logit per token (weight [1, hidden]); sigmoid scales the shared expert."""

    def __init__(self, hidden: int) -> None:
        super().__init__(hidden, 1)


class SparseMoE(nn.Module):
    """Router + experts (+ shared expert) of one decoder layer. ``make_mlp(intermediate, tp,
    reduce)`` builds one gated MLP (the model's own, so names match its checkpoint)."""

    def __init__(self, hidden: int, moe: MoEArgs, make_mlp: Callable[..., nn.Module],
                 tp: TPGroup = SINGLE, expert_parallel: bool = False) -> None:
        super().__init__()
        self.tp, self.expert_parallel = tp, expert_parallel
        self.num_experts, self.top_k, self.renormalize = moe.num_experts, moe.top_k, moe.renormalize
        self.gate = Router(hidden, moe.num_experts)
        self.local = expert_shards(moe.num_experts, tp.size)[tp.rank] if expert_parallel else None
        expert_tp = SINGLE if expert_parallel else tp
        # Experts another rank holds are left out of this rank's module list, so their
        # checkpoint tensors are skipped (``skips_checkpoint_tensor``) and never read.
        self.experts = nn.ModuleDict({
            str(e): make_mlp(moe.expert_intermediate_size, expert_tp, False)
            for e in (self.local if expert_parallel else range(moe.num_experts))})
        self._by_id = {int(e): m for e, m in self.experts.items()}
        self._new_expert = lambda: make_mlp(moe.expert_intermediate_size, SINGLE, False)
        # Expert parallel: hot experts copied onto every rank split their tokens over the
        # ranks (``set_replicas``); ``shares`` says which of each expert's tokens run here.
        self.replicated: frozenset = frozenset()
        self.shares = {e: (0, 1) for e in self.local} if expert_parallel else None
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = make_mlp(moe.shared_expert_intermediate_size, tp, False)
            self.shared_expert_gate = SharedExpertGate(hidden)
        self.load: Optional[ExpertLoad] = None   # set by the model: shared by its MoE layers
        self.load_index = 0

    def set_replicas(self, experts, build: Callable[[int, nn.Module], None]) -> None:
        """Expert parallel: hold ``experts`` (besides this rank's own) on every rank from now
        on. ``build(e, module)`` loads expert e's weights into a fresh module; replicas no
        longer listed are dropped. Every rank must make the same call (the splits agree)."""
        if not self.expert_parallel:
            raise ValueError("expert replicas need expert parallelism")
        wanted = frozenset(int(e) for e in experts)
        for e in self.replicated - wanted:
            if e not in self.local:
                del self.experts[str(e)]
                del self._by_id[e]
        for e in sorted(wanted - self.replicated):
            if e not in self.local:
                module = self._new_expert()
                build(e, module)
                self.experts[str(e)] = module
                self._by_id[e] = module
        self.replicated = wanted
        shares = {e: (0, 1) for e in self.local}
        shares.update({e: (self.tp.rank, self.tp.size) for e in wanted})
        self.shares = shares

    def _record_rank_pairs(self, per_expert: torch.Tensor, counts: list[int]) -> None:
        """(token, expert) pairs each rank computes this step: its own experts' tokens, and
        every size-th token of each replicated expert (as ``combine_experts`` splits them)."""
        size = self.tp.size
        per_rank = per_expert.view(size, -1).sum(dim=1)
        for e in self.replicated:
            per_rank[e // (self.num_experts // size)] -= counts[e]
            for r in range(size):
                per_rank[r] += len(range(r, counts[e], size))
        self.load.rank_pairs.add_(per_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [T, hidden]
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        per_expert = torch.bincount(ids.reshape(-1), minlength=self.num_experts)
        # one token needs no grouping (nor, without replicas, the counts)
        counts = per_expert.tolist() if x.shape[0] > 1 or self.replicated else []
        if self.load is not None:
            self.load.record(self.load_index, per_expert)
            if self.load.rank_pairs is not None:
                self._record_rank_pairs(per_expert, counts)
        by_id = self._by_id
        out = combine_experts(x, weights, ids, lambda e, rows: by_id[e](rows), counts, self.shares)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out) if self.tp.is_parallel else out
