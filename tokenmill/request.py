"""Request: one sequence being generated, and its lifecycle status.

The one idea of the engine: ``num_computed_tokens`` chases ``num_tokens`` (prompt + output).
A prefill chunk, a decode token and a prefix-cache hit all just advance the first; preemption
resets it to 0.
"""
from __future__ import annotations

import enum
import time
from typing import Optional

from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> Optional[str]:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """Engine-side state of one sequence (one of the ``n`` samples of a user request).

    A *pooling* request (``pooling_params`` set) is prompt-only: ``max_tokens`` is 0, it never
    samples and finishes once its prompt is computed. Its ``sampling_params`` are the defaults
    and never drive sampling; they are there so code that reads them for every request needs
    no None check."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_tokens: int, arrival_time: Optional[float] = None, priority: int = 0,
                 cache_salt: Optional[str] = None, parent_id: Optional[str] = None,
                 sample_index: int = 0, grammar=None,
                 pooling_params: Optional[PoolingParams] = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = params
        self.pooling_params = pooling_params
        self.max_tokens = max_tokens              # resolved against max_model_len
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority                  # lower value = served first (priority policy)
        self.cache_salt = cache_salt
        self.parent_id = parent_id or request_id  # user-visible id shared by the n samples
        self.sample_index = sample_index
        # tokenmill.structured.grammar.GrammarMatcher when the output follows a grammar: it
        # tracks the output tokens (kept across preemption, as the tokens are).
        self.grammar = grammar
        self.drafts_are_forced = False            # spec_token_ids came from the grammar
        self.output_token_ids: list[int] = []
        # Draft tokens proposed for the next step: scheduled after the newest token, verified
        # by the target, then replaced (never appended to the output as such).
        self.spec_token_ids: list[int] = []
        # their parents when they form a tree (spec/draft_tree.py; None: a chain)
        self.spec_parents: Optional[list[int]] = None
        self.num_computed_tokens = 0              # tokens whose KV is in the cache
        self.num_cached_tokens = 0                # of the prompt, served by the prefix cache
        self.status = RequestStatus.WAITING
        self.stop_reason: Optional[object] = None # stop string or token id that ended it
        self.error: Optional[str] = None
        self.num_preemptions = 0
        self.first_scheduled_time: Optional[float] = None
        self.first_token_time: Optional[float] = None
        self.finished_time: Optional[float] = None

    # -- counts ---------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def needs_every_prompt_row(self) -> bool:
        """Prompt logprobs and mean pooling read every prompt position's hidden state, so
        the prefix cache must not skip any of them."""
        if self.pooling_params is not None:
            return self.pooling_params.needs_every_prompt_row
        return self.sampling_params.prompt_logprobs is not None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
