"""Test-only fault injection: the runner's hooks that make a FaultRule (tokenmill.config)
happen, so the engine's promise -- a failure stays with the request that caused it -- is
tested on the real code path rather than argued.

A rule picks its requests by content (a token sequence in the prompt), not by id: every
tensor-parallel rank sees the same SchedulerOutput, so a rule fires on every rank in the
same step, and a client of the server can trigger it without knowing internal ids.
"""
from __future__ import annotations

import os
import signal
from typing import Optional

import torch


class InjectedFault(RuntimeError):
    """Raised by a ``forward_error`` / ``sample_error`` rule."""


def _contains(tokens: list[int], pattern: tuple) -> bool:
    n = len(pattern)
    first = pattern[0]
    for i in range(len(tokens) - n + 1):
        if tokens[i] == first and tuple(tokens[i:i + n]) == pattern:
            return True
    return False


class FaultInjector:
    """Holds the rules one rank fires and how often each fired. The runner calls
    ``before_forward``, ``before_sample`` and ``poison_logits`` once per step each."""

    def __init__(self, rules: tuple, rank: int) -> None:
        self.rules = [r for r in rules if not r.ranks or rank in r.ranks]
        self.num_fired = [0] * len(self.rules)

    def _firing(self, kind: str, req_ids, states) -> Optional[str]:
        """The first of ``req_ids`` a rule of ``kind`` fires on now (counted), or None."""
        for i, rule in enumerate(self.rules):
            if rule.kind != kind or (rule.max_fires and self.num_fired[i] >= rule.max_fires):
                continue
            for req_id in req_ids:
                state = states[req_id]
                if len(state.output_token_ids) == rule.at_output_token and \
                        _contains(state.prompt_token_ids, rule.trigger_token_ids):
                    self.num_fired[i] += 1
                    return req_id
        return None

    def before_forward(self, req_ids, states) -> None:
        if self._firing("kill_worker", req_ids, states) is not None:
            os.kill(os.getpid(), signal.SIGKILL)   # as the OOM killer would: no clean-up
        req_id = self._firing("forward_error", req_ids, states)
        if req_id is not None:
            raise InjectedFault(f"injected forward error (request {req_id})")

    def before_sample(self, req_ids, states) -> None:
        req_id = self._firing("sample_error", req_ids, states)
        if req_id is not None:
            raise InjectedFault(f"injected sampling error (request {req_id})")

    def poison_logits(self, logits: torch.Tensor, sample_req_ids, states,
                      rows_per_request: list[int]) -> None:
        """logits [sum(rows_per_request), V]: NaN in every row of the requests a
        ``nan_logits`` rule fires on (each fires at most once per step)."""
        start = 0
        for req_id, n in zip(sample_req_ids, rows_per_request):
            if self._firing("nan_logits", [req_id], states) is not None:
                logits[start:start + n] = float("nan")
            start += n
