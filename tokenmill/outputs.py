"""Data handed between runner, scheduler, engine and user (no torch)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Logprob:
    """One candidate token at one position: its log-probability under the model (raw logits),
    its rank (1 = most likely) and its text once detokenized."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# Per position: token id -> Logprob (the chosen token plus the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class ModelRunnerOutput:
    """Per scheduled request (in ``req_ids`` order): sampled tokens (empty for a prefill chunk
    that does not reach the end of the sequence; 1..k+1 when k drafts were verified), optional
    logprobs, optional errors."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[Optional[PositionLogprobs]]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    # req_id -> draft tokens proposed for the next step (speculative decoding)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> the parent of each of those drafts when they form a tree (spec/draft_tree.py)
    draft_parents: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> pooled vector of a pooling request whose prompt was completed this step
    pooled: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """What changed for one request in one step."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] = field(default_factory=list)
    new_prompt_logprobs: list[Optional[PositionLogprobs]] = field(default_factory=list)
    finished: bool = False
    finish_reason: Optional[str] = None
    stop_reason: object = None
    error: Optional[str] = None
    pooled: Optional[list[float]] = None     # a pooling request's vector (with finished)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[PositionLogprobs]]
    finish_reason: Optional[str] = None
    stop_reason: object = None
    error: Optional[str] = None          # why the engine failed this sample (finish_reason "error")

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """The result of a pooling request, in vLLM's spelling (``out.outputs.embedding``).
    ``outputs`` is None until it finishes, and stays None when it failed (``error``)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: Optional[EmbeddingOutput]
    finished: bool
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    num_cached_tokens: int = 0


def failure_reasons(out) -> list[Optional[str]]:
    """Why a finished RequestOutput / EmbeddingRequestOutput failed: one entry per failed
    sample (its message may be None), empty when nothing failed."""
    if isinstance(out, EmbeddingRequestOutput):
        return [out.error] if out.finish_reason == "error" else []
    return [c.error for c in out.outputs if c.finish_reason == "error"]
