"""Top-k, top-p and min-p filtering on temperature-scaled logits. Removed tokens become -inf.

Ties at the top-k boundary are all kept (a threshold compare), as in vLLM; with real-valued
logits ties are rare and any tied token is equally "in the top k".
"""
from __future__ import annotations

from typing import Optional

import torch

_NEG_INF = float("-inf")


def apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Top-k without a full sort: the k-th largest value of each row is its keep threshold."""
    # logits [R, V]; top_k [R] int64 in [1, V]
    max_k = int(top_k.max())
    top_values = logits.topk(max_k, dim=-1).values  # [R, max_k], descending
    threshold = top_values.gather(1, (top_k - 1).unsqueeze(1))  # [R, 1]
    return logits.masked_fill(logits < threshold, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                      top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """Filtered copy of logits [R, V]. top_k [R] (V = disabled), top_p [R] (1.0 = disabled).

    Top-p keeps the smallest set of most likely tokens whose probability (after top-k) reaches p;
    the most likely token always survives.
    """
    if top_k is None and top_p is None:
        return logits
    if top_p is None:
        return apply_top_k_only(logits, top_k)
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # ascending: last = most likely
    V = logits.shape[-1]
    if top_k is not None:
        threshold = sorted_logits.gather(1, (V - top_k).unsqueeze(1))  # [R, 1]
        sorted_logits.masked_fill_(sorted_logits < threshold, _NEG_INF)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when it and everything less likely add up to at most 1 - p.
    drop = probs.cumsum(dim=-1) <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens whose probability is at least min_p times the most likely token's."""
    # logits [R, V]; min_p [R]
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, _NEG_INF)
