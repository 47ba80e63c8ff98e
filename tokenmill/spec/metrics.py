"""Speculative decoding counters (vLLM's names) and timings; pure Python.

- a *draft* is one request's k >= 1 draft tokens in one step; ``num_draft_tokens`` sums k.
- ``num_accepted_tokens``: drafts the target kept; ``accepted_per_position[j]``: how often the
  (j + 1)-th draft was kept.
- mean acceptance length tau = tokens per target forward for a drafted request
  = 1 + accepted / drafts (the recovered or bonus token included).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list = field(default_factory=list)
    num_steps: int = 0                 # steps that verified at least one draft
    draft_time: float = 0.0            # seconds proposing
    verify_time: float = 0.0           # seconds in steps that verified drafts
    k_chosen: dict = field(default_factory=dict)   # k -> steps it was chosen for

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def on_verified(self, num_drafts: int, num_emitted: int) -> None:
        """One request verified num_drafts drafts and emitted num_emitted tokens."""
        if num_drafts <= 0 or num_emitted <= 0:
            return
        accepted = num_emitted - 1
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted
        for j in range(min(accepted, len(self.accepted_per_position))):
            self.accepted_per_position[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def snapshot(self, estimated_speedup: float) -> dict:
        return {
            "spec_num_drafts": self.num_drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_accepted_per_position": list(self.accepted_per_position),
            "spec_acceptance_rate": self.acceptance_rate,
            "spec_mean_acceptance_length": self.mean_acceptance_length,
            "spec_num_verify_steps": self.num_steps,
            "spec_draft_time_s": self.draft_time,
            "spec_verify_time_s": self.verify_time,
            "spec_k_chosen": dict(sorted(self.k_chosen.items())),
            "spec_estimated_speedup": estimated_speedup,
        }
