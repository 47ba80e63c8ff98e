"""Speculative decoding counters (vLLM's names), timings and per-request stats; pure Python.

Terms (aggregate and per request):

- a *draft* is one request's k >= 1 draft tokens verified in one step; ``num_draft_tokens``
  sums k. ``num_accepted_tokens``: drafts the target kept; ``accepted_per_position[j]``: how
  often the (j + 1)-th draft was kept. Each draft also emits one recovered or bonus token, so
  a drafted request emits ``accepted + 1`` tokens per step (``num_emitted_tokens`` sums them).
- mean acceptance length tau = tokens per target forward for a drafted request
  = 1 + accepted / drafts (the recovered or bonus token included).
- *draft time*: wall seconds the proposer spent producing drafts (batched: every request in a
  proposer call is charged the whole call, since each waited for all of it).
- *verify time*: wall seconds of the steps that verified drafts, from the runner's step start
  to the end of rejection sampling (input building, the target forward, verification). A
  request is charged the whole step for each step in which it had drafts.
- *plain step cost* c(B): seconds of a plain decode step at batch size B (every scheduled
  request decodes one token, no drafts, no prefill chunk), an exponential moving average per
  power-of-two batch bucket, measured in this engine (see ``PlainStepCost``).
- *estimated speedup* = (tokens emitted) x c(B) / (draft time + step time), summed over the
  decode-only steps measured while c(B) was known: the time plain decoding would have needed
  for the same tokens over the time speculation took. Per request, tokens and times are the
  request's own (its latency speedup); in aggregate, c(B) is divided by B (a plain step emits
  B tokens: a throughput speedup). Steps where a request had no drafts count too (adaptive
  k = 0, no n-gram match), so a request that never speculated scores about 1.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from tokenmill.spec.adaptive import bucket_of

RECENT_REQUESTS = 256       # finished requests kept for get_stats() / the server


class PlainStepCost:
    """c(B): EMA of plain decode step seconds per batch bucket. Known after ``min_samples``
    samples; ``wants_sample`` asks for a plain step when a bucket has too few samples or none
    for ``refresh_every`` steps (so a fixed-k decoder, which never chooses k = 0 itself, still
    measures it: about 1 step in ``refresh_every``, which costs well under 1% of the gain)."""

    def __init__(self, ema: float = 0.25, min_samples: int = 2, refresh_every: int = 256) -> None:
        self.ema, self.min_samples, self.refresh_every = ema, min_samples, refresh_every
        self.seconds: dict[int, float] = {}
        self.count: dict[int, int] = {}
        self._since: dict[int, int] = {}

    def record(self, batch_size: int, seconds: float) -> None:
        b = bucket_of(batch_size)
        n = self.count.get(b, 0)
        self.seconds[b] = seconds if n == 0 else (1 - self.ema) * self.seconds[b] + self.ema * seconds
        self.count[b] = n + 1
        self._since[b] = 0

    def get(self, batch_size: int) -> Optional[float]:
        b = bucket_of(batch_size)
        return self.seconds[b] if self.count.get(b, 0) >= self.min_samples else None

    def wants_sample(self, batch_size: int) -> bool:
        """Called once per step that could draft; True = make this step plain."""
        b = bucket_of(batch_size)
        self._since[b] = self._since.get(b, 0) + 1
        if self.refresh_every <= 0:
            return False
        return self.count.get(b, 0) < self.min_samples or self._since[b] > self.refresh_every


@dataclass
class RequestSpecStats:
    """One request's share of the counters and timings (terms in the module docstring)."""

    request_id: str
    num_output_tokens: int = 0         # runner-emitted, while the decoder ran (before stop trimming)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0        # in steps where it had drafts
    draft_time: float = 0.0
    verify_time: float = 0.0
    plain_equiv_time: float = 0.0      # sum of tokens x c(B) over measured steps
    measured_time: float = 0.0         # sum of step + drafting seconds over the same steps
    finished: bool = False

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def estimated_speedup(self) -> Optional[float]:
        return self.plain_equiv_time / self.measured_time if self.measured_time > 0 else None

    def as_dict(self) -> dict:
        speedup = self.estimated_speedup
        return {
            "request_id": self.request_id, "finished": self.finished,
            "num_output_tokens": self.num_output_tokens,
            "num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_emitted_tokens": self.num_emitted_tokens,
            "acceptance_rate": (self.num_accepted_tokens / self.num_draft_tokens
                                if self.num_draft_tokens else 0.0),
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_time_s": self.draft_time, "verify_time_s": self.verify_time,
            "estimated_speedup": None if speedup is None else round(speedup, 4),
        }


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
    plain_equiv_time: float = 0.0      # sum of tokens x c(B) / B over measured steps
    measured_time: float = 0.0         # sum of step + drafting seconds over the same steps
    k_chosen: dict = field(default_factory=dict)   # k -> steps it was chosen for
    cheaper_mode_steps: int = 0        # of the k > 0 steps: those in a proposer's cheaper mode
    tree_steps: int = 0                # of the k > 0 steps: those drafting a tree (not its chain alone)
    live: dict = field(default_factory=dict)       # req_id -> RequestSpecStats, not finished
    finished: deque = field(default_factory=lambda: deque(maxlen=RECENT_REQUESTS))
    num_finished: int = 0

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    # -- recording ----------------------------------------------------------------------------
    def request(self, req_id: str) -> RequestSpecStats:
        r = self.live.get(req_id)
        if r is None:
            r = self.live[req_id] = RequestSpecStats(req_id)
        return r

    def on_verified(self, num_drafts: int, num_emitted: int, req_id: Optional[str] = None,
                    step_seconds: float = 0.0) -> None:
        """One request verified num_drafts drafts and emitted num_emitted tokens in a step that
        took step_seconds."""
        if num_drafts <= 0 or num_emitted <= 0:
            return
        accepted = num_emitted - 1
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted
        for j in range(min(accepted, len(self.accepted_per_position))):
            self.accepted_per_position[j] += 1
        if req_id is not None:
            r = self.request(req_id)
            r.num_drafts += 1
            r.num_draft_tokens += num_drafts
            r.num_accepted_tokens += accepted
            r.num_emitted_tokens += num_emitted
            r.verify_time += step_seconds

    def finish(self, req_id: str) -> None:
        """The request finished (or was aborted): move it to the bounded recent list."""
        r = self.live.pop(req_id, None)
        if r is not None:
            r.finished = True
            self.finished.append(r)
            self.num_finished += 1

    def finished_since(self, seen: int) -> list[RequestSpecStats]:
        """Requests finished after the first ``seen`` (as many as the window still holds)."""
        new = min(self.num_finished - seen, len(self.finished))
        return list(self.finished)[len(self.finished) - new:] if new > 0 else []

    # -- reading ------------------------------------------------------------------------------
    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def estimated_speedup(self) -> float:
        """0.0 until a measured step (see the module docstring)."""
        return self.plain_equiv_time / self.measured_time if self.measured_time > 0 else 0.0

    def counters(self) -> dict:
        """Cumulative aggregate, vLLM's names (cheap: read after every server step)."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.accepted_per_position),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "num_verify_steps": self.num_steps,
            "draft_time_s": self.draft_time,
            "verify_time_s": self.verify_time,
            "estimated_speedup": self.estimated_speedup,
        }

    def requests(self) -> list[dict]:
        """The last RECENT_REQUESTS finished requests (oldest first), then the running ones."""
        return [r.as_dict() for r in list(self.finished) + list(self.live.values())]

    def snapshot(self, predicted_speedup: float) -> dict:
        """Flat ``spec_*`` keys merged into get_stats() (kept for existing readers)."""
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
            "spec_cheaper_mode_steps": self.cheaper_mode_steps,
            "spec_tree_steps": self.tree_steps,
            "spec_estimated_speedup": self.estimated_speedup,
            "spec_adaptive_predicted_speedup": predicted_speedup,
        }
