"""What the scheduler does for grammar-constrained requests (pure Python, no torch): the
step's token masks, drafts cut to the grammar (or the tokens it forces), and stepping the
grammar over emitted tokens."""
from __future__ import annotations

from typing import Optional

from tokenmill.request import Request, RequestStatus
from tokenmill.sched.output import GrammarBitmask
from tokenmill.structured.grammar import fill_bitmasks
from tokenmill.structured.stats import GrammarStats


def grammar_bitmask(requests: dict[str, Request], num_scheduled: dict[str, int],
                    spec: dict[str, list[int]]) -> Optional[GrammarBitmask]:
    """Masks of the grammar-constrained requests that sample this step (their scheduled
    tokens reach the end of the sequence; a mid-prompt chunk samples nothing)."""
    req_ids, entries, starts, num_rows = [], [], [], 0
    for req_id, num_new in num_scheduled.items():
        req = requests[req_id]
        if req.grammar is None or req.num_computed_tokens + num_new < req.num_tokens:
            continue
        drafts = spec.get(req_id, [])
        req_ids.append(req_id)
        entries.append((req.grammar, drafts))
        starts.append(num_rows)
        num_rows += len(drafts) + 1
    if not entries:
        return None
    words = entries[0][0].words_per_row
    return GrammarBitmask(req_ids, starts, words, fill_bitmasks(entries, words).tobytes())


def grammar_drafts(req: Request, drafts: list[int], max_forced_drafts: int) -> list[int]:
    """The proposer's drafts cut to what the grammar accepts, or the tokens the grammar
    forces next when the drafts do not start with them (forced tokens are accepted unless
    the model spells the same text with other tokens)."""
    drafts = drafts[:req.grammar.valid_prefix(drafts)]
    forced = req.grammar.forced_tokens(max_forced_drafts)
    if drafts[:len(forced)] == forced:
        return drafts
    req.drafts_are_forced = True
    return forced


def advance_grammar(req: Request, token: int, stats: GrammarStats) -> Optional[RequestStatus]:
    """Step the request's grammar over an emitted token. A terminated grammar only lets
    an end-of-sequence token through, which the stop check ends the request on."""
    grammar = req.grammar
    if grammar is None or grammar.is_terminated or grammar.accept(token):
        return None
    stats.num_failed_requests += 1
    req.error = f"token {token} is outside the request's grammar ({grammar.error})"
    return RequestStatus.FINISHED_ERROR
