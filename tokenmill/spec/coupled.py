"""Drafts that race with the target's own sampling noise (T > 0).

The target samples a random row as argmax_i p_i / E_i, E_i ~ Exp(1) drawn from the request's
(seed, output position) (sample/sampler.py, ``position_noise``). A drafter that reads those
E_i before the target does can propose argmax_i q_i / E_i over its own distribution q: when q
is close to p both races mostly pick the same token, whereas a greedy draft is accepted only
with probability p(argmax q). (SmolLM2 chat at T=1, the trained EAGLE-3's first draft: 0.19
greedy, 0.23 racing; docs/bench/2026-12-04e.)

Verification does not change: a point draft is kept iff it equals the target's own sample
at that row, so a seeded request emits the very tokens it emits without speculation, and
every output is distributed as the target's. Random requests without a seed get one from the
runner when its drafter couples (``couples_noise``), so every random row's noise is a
function of (seed, position).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from tokenmill.sample.filters import apply_top_k_top_p
from tokenmill.sample.sampler import position_noise


def coupled(state) -> bool:
    """Does this request's next draw race against noise a drafter can read?"""
    return state.seed is not None and not state.params.is_greedy


def noise_row(state, position: int, vocab: int, device) -> torch.Tensor:
    """[vocab] the target's noise for ``state`` at output ``position``, drawn once: it is kept
    in ``state.drawn_noise``, where the runner's sampler takes it instead of drawing it again,
    while ``state.noise_budget`` (None: no cap) has room for it."""
    row = state.drawn_noise.get(position)
    if row is None:
        row = position_noise(state.seed, position, vocab, device)
        budget = state.noise_budget
        if budget is None or budget.take(row.numel() * row.element_size()):
            state.drawn_noise[position] = row
    return row


def draft_tokens(logits: torch.Tensor, states: list, positions: list[int], vocab: int,
                 to_target: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 width: int = 1):
    """One draft per row of ``logits`` [R, Vd] (float; a draft vocabulary mapped to target ids
    by ``to_target``, or None: the target's own ids): the argmax for greedy rows, else the race
    of q = softmax(logits / T) (with the request's top-k / top-p) against the target's noise
    of ``states[r]`` at output position ``positions[r]`` (``vocab``: the target's logits
    width). Returns target ids [R]; with ``width`` > 1 also the runners-up of each row's
    race, [R, width - 1] target ids (draft-tree alternatives, best first)."""
    scores = _race_scores(logits, states, positions, vocab, to_target)
    tokens = scores.argmax(-1)
    if width == 1:
        return tokens if to_target is None else to_target(tokens)
    # the runners-up: the best width - 1 others (topk may order ties unlike argmax)
    top = scores.topk(min(width, scores.shape[-1]), dim=-1).indices
    others = torch.stack([row[row != t][:width - 1] for row, t in zip(top, tokens)]) \
        if top.shape[0] else top[:, 1:]
    if to_target is not None:
        tokens, others = to_target(tokens), to_target(others)
    return tokens, others


def _race_scores(logits: torch.Tensor, states: list, positions: list[int], vocab: int,
                 to_target) -> torch.Tensor:
    """[R, Vd]: each row's draft is its argmax (greedy rows: the logits; coupled rows:
    q / E, the race against the target's noise)."""
    rows = [r for r, s in enumerate(states) if coupled(s)]
    if not rows:
        return logits
    scores = logits.float().clone()
    target_ids = None if to_target is None else \
        to_target(torch.arange(logits.shape[-1], device=logits.device))
    for r in rows:
        params = states[r].params
        scaled = (logits[r:r + 1].float() / params.temperature)
        if 0 < params.top_k < logits.shape[-1] or params.top_p < 1.0:
            top_k = params.top_k if 0 < params.top_k < logits.shape[-1] else logits.shape[-1]
            scaled = apply_top_k_top_p(scaled, torch.tensor([top_k], device=logits.device),
                                       torch.tensor([params.top_p], device=logits.device))
        noise = noise_row(states[r], positions[r], vocab, logits.device)
        if target_ids is not None:
            noise = noise[target_ids]
        # out of place: the row stays in the request state for the sampler, unchanged
        q = scaled.softmax(-1)[0]
        scores[r] = q / noise.clamp_min(torch.finfo(torch.float32).tiny)
    return scores
