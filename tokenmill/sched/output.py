"""What the scheduler hands to the model runner for one step (no torch)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen yet (or is seeing again after preemption): sent in full."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_tables: tuple[list[int], ...]   # per KV group (kv/layout.py), group 0 first
    num_computed_tokens: int
    generator_seed: int | None       # per-request seed (already offset for the n-th sample)
    pooling_params: PoolingParams | None = None   # set for a prompt-only (pooling) request


@dataclass(frozen=True)
class CachedRequestData:
    """A request the runner already holds: only what changed."""

    req_id: str
    new_block_ids: tuple[list[int], ...]   # per KV group: blocks appended to its table
    num_computed_tokens: int


@dataclass(frozen=True)
class GrammarBitmask:
    """Allowed next tokens of the step's grammar-constrained requests that sample.

    Request ``req_ids[i]`` owns k + 1 rows from ``row_starts[i]`` (k = its scheduled drafts):
    the mask after its newest token, then after each draft. A row is ``words_per_row`` int32
    words (little-endian in ``data``); bit ``t % 32`` of word ``t // 32`` set = token t allowed.
    """

    req_ids: list[str]
    row_starts: list[int]
    words_per_row: int
    data: bytes


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]         # req_id -> tokens to compute this step
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)    # runner may drop their state
    preempted_req_ids: set[str] = field(default_factory=set)
    # req_id -> draft tokens scheduled after its newest token (counted in num_scheduled_tokens)
    scheduled_spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> the parent of each scheduled draft when they form a tree (spec/draft_tree.py);
    # absent: a chain
    scheduled_spec_parents: dict[str, list[int]] = field(default_factory=dict)
    grammar_bitmask: GrammarBitmask | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
