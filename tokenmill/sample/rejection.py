"""Rejection sampler for speculative decoding: verify k draft tokens per request in one pass.

A request with k draft tokens x_1..x_k is scored by the target at k + 1 consecutive rows: row j
holds p_j, the target's (processed, filtered) distribution for the token after the newest token
and x_1..x_j (row 0 = after the newest token alone). Per request the sampler returns 1..k+1
tokens:

- *accepted* tokens: the leading drafts kept by the rule. x_j is kept with probability
  min(1, p_j(x_j) / q_j(x_j)), q_j being the draft distribution it was drawn from.
- *recovered* token: at the first rejected position j, a replacement drawn from the residual
  norm(max(0, p_j - q_j)). (Drawing it from p_j instead is the classic mistake: it biases the
  output towards tokens the drafter likes.)
- *bonus* token: when all k drafts are accepted, one extra token drawn from p_k (row k).

So a request emits a accepted tokens plus one recovered or bonus token, and each emitted token
is distributed exactly as if the target had sampled it alone (Leviathan et al. 2023).

Two kinds of drafts:
- *point drafts* (``draft_probs`` None): the drafter chose x_j deterministically (n-gram
  lookup, greedy drafters), i.e. q_j is one-hot at x_j. Then the rule accepts with probability
  p_j(x_j), and the residual is p_j without x_j. We draw t_j ~ p_j at every row with the plain
  sampler (the same exponential race, the same per-(seed, position) noise) and accept x_j iff
  t_j == x_j; on the first mismatch t_j *is* a residual draw, and after k matches t_k is the
  bonus. Same law as the rule, and a seeded request emits the very tokens it would emit
  without speculation, whatever k is. Greedy rows take the argmax: accept while it matches.
- *probability drafts* (``draft_probs`` [num_drafts, V]): x_j ~ q_j; accept when
  u_j * q_j(x_j) <= p_j(x_j) with u_j ~ U(0, 1); recovered tokens race on max(0, p_j - q_j).

*Draft trees* (tokenmill.spec.draft_tree: a chain plus leaf alternatives; point drafts only):
row 0 is the root, row i + 1 node i, each shaped as if its ancestors were output already and
drawing at output position n0 + its depth. t is drawn at every row as above; from the root,
while t at the current row equals one of the node's children, that child is kept. Every
emitted token is the target's own draw at its position, as with a chain, so the law (and a
seeded request's tokens) are those of plain decoding.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

import torch

from tokenmill.sample.logprobs import LogprobsTensors, compute_logprobs
from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sample.penalties import apply_logits_processors
from tokenmill.sample.sampler import Argmax, Sampler, filtered_probs, sample_from_probs, torch_argmax
from tokenmill.spec import draft_tree

__all__ = ["RejectionOutput", "RejectionSampler", "accepted_prefix_lengths", "emitted_tokens"]


@dataclass
class RejectionOutput:
    token_ids: list[list[int]]      # per request: accepted + one recovered or bonus token
    num_accepted: list[int]         # per request: a, in [0, k]
    row_starts: list[int]           # first of the request's k + 1 rows
    logprobs: Optional[LogprobsTensors]   # per row, of the token emitted at that row
    # per request: the rows whose draws it emitted, in order (a chain: its first a + 1 rows;
    # a tree: the root's and the kept nodes')
    emitted_rows: list[list[int]]


class _Verdict(NamedTuple):
    accepted: torch.Tensor   # [B, K] bool: draft j passed the rule (ignoring earlier drafts)
    mask: torch.Tensor       # [B, K] bool: a real draft (k_b <= K)
    rows: torch.Tensor       # [B, K] int64: its verification row
    drafts: torch.Tensor     # [B, K] int64: the draft token (-1 padding)


def row_starts(num_draft_tokens: list[int]) -> list[int]:
    starts, total = [], 0
    for k in num_draft_tokens:
        starts.append(total)
        total += k + 1
    return starts


def _draft_rows(num_draft_tokens: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, K] row index of each draft's verification row (padding points at row 0) and a
    [B, K] mask of real entries; K = max k."""
    starts = row_starts(num_draft_tokens)
    width = max(max(num_draft_tokens, default=0), 1)
    rows = [[s + j if j < k else 0 for j in range(width)] for s, k in zip(starts, num_draft_tokens)]
    mask = [[j < k for j in range(width)] for k in num_draft_tokens]
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(mask, dtype=torch.bool, device=device))


def accepted_prefix_lengths(accepted: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """accepted/mask [B, K] bool -> [B] int64 number of leading accepted drafts."""
    return (accepted & mask).to(torch.int64).cumprod(dim=1).sum(dim=1)


def emitted_tokens(final: list[int], drafts: list[list[int]], num_accepted: list[int],
                   starts: list[int]) -> list[list[int]]:
    """Per request: its a accepted drafts, then ``final`` at row a (recovered or bonus)."""
    return [d[:a] + [final[s + a]] for d, a, s in zip(drafts, num_accepted, starts)]


class RejectionSampler:
    def __init__(self, argmax: Argmax = torch_argmax) -> None:
        self.sampler = Sampler(argmax)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata, draft_token_ids: list[list[int]],
                 draft_probs: Optional[torch.Tensor] = None,
                 draft_parents: Optional[list[Optional[list[int]]]] = None) -> RejectionOutput:
        """logits [N, V] raw target logits, N = sum(k_b + 1); meta describes the N rows (row j's
        output history includes the request's drafts before it, its noise is drawn for output
        position n0 + j; for a tree, node j's ancestors and n0 + its depth); draft_token_ids per
        request; draft_probs [sum k_b, V] or None; draft_parents: per request, its drafts'
        parents when they form a tree, else None."""
        num_drafts = [len(d) for d in draft_token_ids]
        starts = row_starts(num_drafts)
        if draft_parents is not None and any(p is not None for p in draft_parents):
            if draft_probs is not None:
                raise ValueError("draft trees are verified as point drafts (no draft_probs)")
            return self._tree(logits, meta, draft_token_ids, draft_parents, starts)
        if draft_probs is None:
            final, v = self._point(logits, meta, draft_token_ids, num_drafts)
        else:
            final, v = self._prob(logits, meta, draft_token_ids, num_drafts, draft_probs)
        num_accepted_t = accepted_prefix_lengths(v.accepted, v.mask)
        num_accepted = num_accepted_t.tolist()
        tokens = emitted_tokens(final.tolist(), draft_token_ids, num_accepted, starts)
        logprobs = None
        if meta.max_num_logprobs is not None:
            chosen = final.clone()   # rows before the first rejection emit their draft
            position = torch.arange(v.mask.shape[1], device=v.mask.device)
            kept = v.mask & (position < num_accepted_t[:, None])
            chosen[v.rows[kept]] = v.drafts[kept]
            logprobs = compute_logprobs(logits, chosen, meta.max_num_logprobs)
        emitted = [list(range(s, s + a + 1)) for s, a in zip(starts, num_accepted)]
        return RejectionOutput(tokens, num_accepted, starts, logprobs, emitted)

    def _tree(self, logits, meta, draft_token_ids, draft_parents, starts) -> RejectionOutput:
        """Point verification of chains and trees alike: the kept path of each request."""
        target = self.sampler(logits, _without_logprobs(meta)).sampled_token_ids   # [N]
        drawn = target.tolist()
        tokens, num_accepted, emitted = [], [], []
        for drafts, parents, s in zip(draft_token_ids, draft_parents, starts):
            parents = list(range(-1, len(drafts) - 1)) if parents is None else parents
            path = draft_tree.accepted_path(parents, drafts, drawn[s:s + len(drafts) + 1])
            rows = [s] + [s + 1 + i for i in path]
            tokens.append([drawn[r] for r in rows])
            num_accepted.append(len(path))
            emitted.append(rows)
        logprobs = None
        if meta.max_num_logprobs is not None:
            logprobs = compute_logprobs(logits, target, meta.max_num_logprobs)
        return RejectionOutput(tokens, num_accepted, starts, logprobs, emitted)

    def _point(self, logits, meta, draft_token_ids, num_drafts):
        # t_j ~ p_j at every row (plain sampler); accept x_j iff t_j == x_j.
        target = self.sampler(logits, _without_logprobs(meta)).sampled_token_ids   # [N]
        rows, mask = _draft_rows(num_drafts, logits.device)
        drafts = _padded(draft_token_ids, rows.shape[1], logits.device)
        return target, _Verdict(target[rows] == drafts, mask, rows, drafts)

    def _prob(self, logits, meta, draft_token_ids, num_drafts, draft_probs):
        p = target_probs(logits, meta)                                       # [N, V]
        rows, mask = _draft_rows(num_drafts, logits.device)
        drafts = _padded(draft_token_ids, rows.shape[1], logits.device)
        flat_rows = rows[mask]                                               # [num_drafts]
        q = torch.zeros_like(p)
        q[flat_rows] = draft_probs.float()
        # Residual at draft rows; bonus rows keep q = 0, so their "residual" is p itself.
        residual = (p - q).clamp_min_(0.0)
        empty = residual.sum(dim=-1, keepdim=True) <= 0    # p == q: x was accepted surely
        residual = torch.where(empty, p, residual)
        final = sample_from_probs(residual, _all_random(meta, p.device), self.sampler.argmax)   # [N]
        uniform = _uniforms(meta, p.shape[0], p.device)                      # [N]
        p_x = p[rows, drafts]
        q_x = q[rows, drafts]
        accepted = uniform[rows] * q_x <= p_x
        return final, _Verdict(accepted & (p_x > 0), mask, rows, drafts)


def target_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """[N, V] target distributions shaped exactly like plain sampling (logits processors, then
    temperature / top-k / top-p / min-p); greedy rows are one-hot at their argmax."""
    processed = apply_logits_processors(logits.float(), meta)
    probs = torch.zeros_like(processed)
    greedy = processed.argmax(dim=-1, keepdim=True)
    probs.scatter_(1, greedy, 1.0)
    if not meta.all_greedy:
        random_logits = processed if meta.all_random else processed[meta.random_rows]
        probs[meta.random_rows] = filtered_probs(random_logits, meta)
    return probs


def _padded(draft_token_ids: list[list[int]], width: int, device) -> torch.Tensor:
    return torch.tensor([d + [-1] * (width - len(d)) for d in draft_token_ids],
                        dtype=torch.int64, device=device).reshape(len(draft_token_ids), width)


def _without_logprobs(meta: SamplingMetadata) -> SamplingMetadata:
    # Logprobs are taken per emitted token afterwards, not of the per-row target draws.
    if meta.max_num_logprobs is None:
        return meta
    return replace(meta, max_num_logprobs=None)


def _all_random(meta: SamplingMetadata, device) -> SamplingMetadata:
    """The row noise for sample_from_probs over all N rows: greedy rows race too, but their
    distribution is one-hot, so the race returns their argmax whatever the noise."""
    if meta.all_random:
        return meta
    seeded = [(meta.random_row_ids[pos], g) for pos, g in meta.seeded_random]
    seeded_rows = {row for row, _ in seeded}
    unseeded = [row for row in range(meta.num_rows) if row not in seeded_rows]
    drawn = {meta.random_row_ids[pos]: row for pos, row in meta.drawn_noise.items()}
    return replace(meta, all_random=True, seeded_random=seeded, drawn_noise=drawn,
                   unseeded_random=(torch.tensor(unseeded, dtype=torch.int64, device=device)
                                    if unseeded else None))


def _uniforms(meta: SamplingMetadata, num_rows: int, device) -> torch.Tensor:
    """[N] U(0,1): seeded random rows draw from their own generator (after their race noise)."""
    u = torch.rand(num_rows, generator=meta.shared_generator, device=device)
    for pos, generator in meta.seeded_random:
        u[meta.random_row_ids[pos]] = torch.rand(1, generator=generator, device=device)[0]
    return u
