"""SamplingParams: how one request's tokens are chosen and when it stops.

Validated at construction; every invalid value raises ``ValueError`` naming the parameter.
Spelling follows vLLM so user code ports unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional, Union

from tokenmill.structured.params import StructuredOutputsParams

_INT64_MAX = 2**63 - 1
_MAX_STOP_STRINGS = 256
_MAX_STOP_STRING_LEN = 1024
_MAX_LOGPROBS = 20
_MAX_N = 128
_MAX_LOGIT_BIAS_ENTRIES = 4096
# Greedy below this temperature: dividing logits by ~0 overflows.
_GREEDY_EPS = 1e-5


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping settings.

    temperature 0 means greedy (argmax). top_k 0 or -1 disables top-k; top_p 1.0 disables
    top-p; min_p 0 disables min-p. ``stop`` strings are matched on detokenized text and never
    appear in the output; ``stop_token_ids`` end the request when sampled (the token is kept in
    ``token_ids`` but its text is not emitted). ``logprobs=k`` returns, per generated position,
    the sampled token's logprob plus the top-k; ``prompt_logprobs=k`` does so for the prompt.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[int, float]] = None
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # A grammar the output must follow (JSON schema, regex, choice, Lark / GBNF); a dict is
    # read as StructuredOutputsParams' fields.
    structured_outputs: Optional[StructuredOutputsParams] = None
    # Set by the engine, not by users: token ids that end the request besides stop_token_ids.
    _all_stop_token_ids: frozenset = field(default=frozenset(), repr=False, compare=False)

    def __post_init__(self) -> None:
        self._validate_counts()
        self._validate_floats()
        self._normalize_stops()
        self._validate_logit_bias()
        if self.structured_outputs is not None:
            object.__setattr__(self, "structured_outputs",
                               StructuredOutputsParams.from_dict(self.structured_outputs))

    # -- validation ------------------------------------------------------------------------
    def _validate_counts(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= _MAX_N:
            raise ValueError(f"n must be an integer in [1, {_MAX_N}], got {self.n!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed)
                                      or not -_INT64_MAX - 1 <= self.seed <= _INT64_MAX):
            raise ValueError(f"seed must be an integer within int64, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= _MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {_MAX_LOGPROBS}], got {value!r}")

    def _validate_floats(self) -> None:
        checks = {
            "temperature": (self.temperature, 0.0, None),
            "top_p": (self.top_p, 0.0, 1.0),
            "min_p": (self.min_p, 0.0, 1.0),
            "repetition_penalty": (self.repetition_penalty, 0.0, None),
            "presence_penalty": (self.presence_penalty, -2.0, 2.0),
            "frequency_penalty": (self.frequency_penalty, -2.0, 2.0),
        }
        for name, (value, lo, hi) in checks.items():
            if not _is_number(value) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            if value < lo or (hi is not None and value > hi):
                bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
                raise ValueError(f"{name} must be {bound}, got {value!r}")
        if self.top_p <= 0.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")

    def _normalize_stops(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, (list, tuple)):
            stop = list(stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
        if len(stop) > _MAX_STOP_STRINGS:
            raise ValueError(f"stop accepts at most {_MAX_STOP_STRINGS} strings, got {len(stop)}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
            if len(s) > _MAX_STOP_STRING_LEN:
                raise ValueError(f"stop strings must be at most {_MAX_STOP_STRING_LEN} characters")
        object.__setattr__(self, "stop", stop)
        ids = list(self.stop_token_ids or [])
        for t in ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")
        object.__setattr__(self, "stop_token_ids", ids)

    def _validate_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError("logit_bias must be a mapping token_id -> bias")
        if len(self.logit_bias) > _MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias accepts at most {_MAX_LOGIT_BIAS_ENTRIES} entries")
        clean = {}
        for key, bias in self.logit_bias.items():
            try:
                token_id = int(key)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
            if token_id < 0:
                raise ValueError(f"logit_bias token id must be >= 0, got {token_id}")
            if not _is_number(bias) or not math.isfinite(bias) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r}")
            clean[token_id] = float(bias)
        object.__setattr__(self, "logit_bias", clean)

    # -- derived ---------------------------------------------------------------------------
    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def check_token_ids(self, vocab_size: int) -> None:
        """Token ids given by the user must exist in the vocabulary (checked once known)."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids contains {t}, outside the vocabulary (size {vocab_size})")
        for t in (self.logit_bias or {}):
            if t >= vocab_size:
                raise ValueError(f"logit_bias contains token id {t}, outside the vocabulary (size {vocab_size})")

    def with_engine_stops(self, eos_token_id: Optional[int]) -> "SamplingParams":
        """Copy with the full set of ids that stop this request (EOS unless ignore_eos)."""
        ids = set(self.stop_token_ids)
        if eos_token_id is not None and not self.ignore_eos:
            ids.add(eos_token_id)
        return replace(self, _all_stop_token_ids=frozenset(ids))

    @property
    def all_stop_token_ids(self) -> frozenset:
        return self._all_stop_token_ids

    def clone(self, **changes) -> "SamplingParams":
        return replace(self, **changes)
