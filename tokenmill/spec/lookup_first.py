"""Prompt lookup first, a drafter elsewhere: each request gets the n-gram proposer's drafts
when its context repeats itself (they cost nothing and are often long), and the drafter's
(EAGLE-3, DFlash, Medusa, a draft model) when there is no match. Small targets loop and copy
their prompt a lot: on SmolLM2 chat, prompt lookup alone accepts longer runs than a trained
EAGLE-3 but finds a match on only part of the steps, which this sends to the drafter.

Verification does not care where a draft came from (every draft is a deterministic proposal,
checked by the same exact rule), so output stays identical to no speculation. A drafter that
keeps a context cache still sees every step's features (``DraftInput.features``), drafted by
it or not."""
from __future__ import annotations

from tokenmill.spec.draft_input import DraftInput


class LookupFirstProposer:
    # mode 1: prompt lookup alone, the drafter only keeping its context. Where a target step is
    # short (gguf-q8 at batch 1: ~4 ms) a trained drafter's drafts cost more than they earn,
    # while lookup's cost nothing: the adaptive controller measures both
    modes = ("lookup, then the drafter", "lookup only")

    def __init__(self, lookup, drafter) -> None:
        self.lookup, self.drafter = lookup, drafter
        self.needs_lookahead = drafter.needs_lookahead
        self.couples_noise = getattr(drafter, "couples_noise", False)
        self.aux_layers = drafter.aux_layers
        if hasattr(drafter, "max_drafts"):
            self.max_drafts = drafter.max_drafts
        self.drafts_by = {"lookup": 0, "drafter": 0}    # requests drafted for, by source

    def propose(self, inp: DraftInput) -> list[list[int]]:
        found = self.lookup.propose(inp)
        rest = [] if inp.mode == 1 else \
            [i for i, (d, n) in enumerate(zip(found, inp.num_drafts)) if n > 0 and not d]
        self.drafts_by["lookup"] += sum(1 for d in found if d)
        self.drafts_by["drafter"] += len(rest)
        hidden = None if inp.hidden is None else inp.hidden[rest]
        got = self.drafter.propose(DraftInput([inp.states[i] for i in rest],
                                              [inp.num_drafts[i] for i in rest], hidden,
                                              inp.features, inp.extra, widths=inp.widths))
        for i, d in zip(rest, got):
            found[i] = d
        return found

    def reset_counts(self) -> None:
        self.drafts_by = dict.fromkeys(self.drafts_by, 0)

    def drop(self, req_ids) -> None:
        self.lookup.drop(req_ids)
        self.drafter.drop(req_ids)
