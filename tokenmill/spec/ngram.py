"""N-gram (prompt lookup) proposer: no extra weights. Find the most recent earlier occurrence
of the sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min) and
propose the tokens that followed it. Pays off when the output copies the input (rewrite,
repeat, answer from a given text, code edits)."""
from __future__ import annotations

import numpy as np


class NgramProposer:
    needs_lookahead = False
    aux_layers = ()

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, inp) -> list[list[int]]:
        return [lookup(s.prompt_token_ids + s.output_token_ids, k, self.min_n, self.max_n) if k > 0
                else [] for s, k in zip(inp.states, inp.num_drafts)]

    def drop(self, req_ids) -> None:
        pass


def lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the last n tokens (longest n
    first), or [] when there is none."""
    if len(tokens) < min_n + 1:
        return []
    seq = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        suffix = seq[-n:]
        # Windows starting at i cover seq[i:i+n]; only i + n < len(seq) leaves a continuation.
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return seq[start:start + k].tolist()
    return []
