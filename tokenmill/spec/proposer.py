"""What a proposer is, and the per-step view of a request it drafts for.

A proposer turns each request's verified tokens (and, for head-based methods, the target's
hidden states: see tokenmill.spec.draft_input) into up to ``num_drafts[i]`` draft tokens. Drafts are point
drafts (chosen greedily), which the rejection sampler verifies exactly for any sampling
settings (see tokenmill.sample.rejection).

``needs_lookahead``: the proposer writes draft K/V into paged slots after the newest token, so
the scheduler must hold ``k`` extra slots per running request (layer_skip, draft_model,
eagle3).

``aux_layers``: decoder layers whose outputs the proposer reads (EAGLE-3, DFlash). When not
empty the runner captures them in every step and calls ``propose`` after every step with
``DraftInput.features`` for all the requests it ran, drafting or not.
"""
from __future__ import annotations

from typing import Protocol

from tokenmill.spec.draft_input import DraftInput


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
    aux_layers: tuple[int, ...]

    def propose(self, inp: DraftInput) -> list[list[int]]:
        """One list of at most ``inp.num_drafts[i]`` tokens per ``inp.states[i]``."""

    def drop(self, req_ids) -> None:
        """Forget per-request state (finished, preempted or re-sent requests)."""
