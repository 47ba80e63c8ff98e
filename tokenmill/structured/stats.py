"""Counters of constrained decoding, kept by the scheduler (cumulative since start-up).

Terms: a *forced draft* is a token the grammar allowed no alternative to, scheduled after a
request's newest token to be verified like a speculative draft; it is *accepted* when the
target emitted it (the model may spell the same text with other tokens instead).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class GrammarStats:
    num_requests: dict = field(default_factory=dict)   # constraint kind -> requests admitted
    num_failed_requests: int = 0          # ended because a token left the grammar
    num_forced_draft_tokens: int = 0      # forced drafts verified
    num_forced_accepted_tokens: int = 0   # of those, emitted

    def count_forced(self, drafts: list[int], num_rejected: int) -> None:
        """A step verified forced ``drafts``, of which ``num_rejected`` were not emitted."""
        self.num_forced_draft_tokens += len(drafts)
        self.num_forced_accepted_tokens += len(drafts) - num_rejected

    def counters(self) -> dict:
        return {"num_requests": dict(self.num_requests),
                "num_failed_requests": self.num_failed_requests,
                "num_forced_draft_tokens": self.num_forced_draft_tokens,
                "num_forced_accepted_tokens": self.num_forced_accepted_tokens}


def merge_counters(counters: list[dict]) -> Optional[dict]:
    """The ``structured_outputs`` counters of several data-parallel replicas, summed."""
    if not counters:
        return None
    kinds = {kind for c in counters for kind in c["num_requests"]}
    total = {key: sum(c[key] for c in counters) for key in counters[0] if key != "num_requests"}
    total["num_requests"] = {k: sum(c["num_requests"].get(k, 0) for c in counters) for k in sorted(kinds)}
    return total
