"""What a proposer is, and the per-step view of a request it drafts for.

A proposer turns each request's verified tokens (and, for head-based methods, the target's
hidden state at its newest token) into up to ``num_drafts[i]`` draft tokens. Drafts are point
drafts (chosen greedily), which the rejection sampler verifies exactly for any sampling
settings (see tokenmill.sample.rejection).

``needs_lookahead``: the proposer writes draft K/V into paged slots after the newest token, so
the scheduler must hold ``k`` extra slots per running request (layer_skip, draft_model).
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch


class DraftState(Protocol):
    """The runner's per-request state, as proposers read it."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int]

    @property
    def num_tokens(self) -> int: ...

    def tokens(self, start: int, end: int) -> list[int]: ...


class Proposer(Protocol):
    needs_lookahead: bool

    def propose(self, states: list[DraftState], num_drafts: list[int],
                hidden: Optional[torch.Tensor]) -> list[list[int]]:
        """hidden [B, hidden_size]: the target's final hidden state at each request's newest
        token's predecessor row (the row whose logits produced the newest token)."""

    def drop(self, req_ids) -> None:
        """Forget per-request state (finished, preempted or re-sent requests)."""
