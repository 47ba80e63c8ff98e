"""A cap on the sampling noise rows kept ahead in request states.

A coupled drafter draws the target's Exp(1) noise of a row before the target samples it
(spec/coupled.py) and keeps the row for the sampler, which saves drawing it twice (~0.6 ms a
row of 49k). A row is vocab x 4 bytes: 1 MB for Gemma3's 262k-token vocabulary, so k rows for
each of many requests add up to hundreds of MB. Past the cap a row is not kept: the sampler
draws it again from the same (seed, position), so the values, and every output, are the same
either way; only that time is spent.
"""
from __future__ import annotations

from typing import Iterable

DEFAULT_MAX_BYTES = 64 << 20   # all requests' kept rows together


class NoiseBudget:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"a noise budget of {max_bytes} bytes; give 0 or more")
        self.max_bytes = max_bytes
        self.used = 0

    def recount(self, states: Iterable) -> None:
        """Bytes the live requests keep now (once a step: rows of emitted positions and of
        finished requests are gone by then)."""
        self.used = sum(row.numel() * row.element_size()
                        for state in states for row in state.drawn_noise.values())

    def take(self, nbytes: int) -> bool:
        """Room for one more row of ``nbytes``? Counts it if so."""
        if self.used + nbytes > self.max_bytes:
            return False
        self.used += nbytes
        return True
