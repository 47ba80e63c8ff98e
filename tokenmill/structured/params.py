"""StructuredOutputsParams: the constraint one request's output must satisfy (vLLM's spelling).

Exactly one of ``json`` (a JSON schema, dict or string), ``json_object`` (any JSON object),
``regex``, ``choice`` (one of a list of strings) or ``grammar`` (Lark, or llama.cpp's GBNF)
is set. Plain data only: it travels with SamplingParams to worker processes (msgpack), and
its ``key`` names the compiled grammar in the compile cache.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Optional, Union

_KINDS = ("json", "json_object", "regex", "choice", "grammar")
_MAX_SPEC_CHARS = 1_000_000
_MAX_CHOICES = 4096


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: Union[None, str, dict] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[list] = None
    grammar: Optional[str] = None
    # Compact JSON (", " / ": " separators, no free whitespace between tokens): what
    # OpenAI's strict mode produces, and it keeps a sampling model from padding forever.
    disable_any_whitespace: bool = True
    _text: str = field(default="", init=False, repr=False, compare=False)   # canonical spec

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, json_object, regex, "
                             f"choice or grammar; got {given or 'none'}")
        kind = given[0]
        text = _canonical(kind, getattr(self, kind))
        if len(text) > _MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs.{kind} is too large ({len(text)} characters; "
                             f"at most {_MAX_SPEC_CHARS})")
        object.__setattr__(self, "_text", text)
        if kind == "json":   # one spelling on the wire: the schema as a JSON string
            object.__setattr__(self, "json", text)

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def text(self) -> str:
        """The constraint as one string: schema JSON, regex, JSON list of choices, grammar."""
        return self._text

    @property
    def key(self) -> str:
        """Cache key of the compiled grammar (kind, options and text)."""
        digest = hashlib.sha256(self._text.encode("utf-8", "surrogatepass")).hexdigest()
        return f"{self.kind}:{int(self.disable_any_whitespace)}:{digest}"

    @classmethod
    def from_dict(cls, value: Union[dict, "StructuredOutputsParams"]) -> "StructuredOutputsParams":
        """From a request body's ``structured_outputs`` object (unknown keys refused)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError("structured_outputs must be an object")
        unknown = set(value) - set(_KINDS) - {"disable_any_whitespace"}
        if unknown:
            raise ValueError(f"structured_outputs: unknown field(s) {sorted(unknown)}; "
                             f"expected one of {list(_KINDS)}")
        return cls(**value)


def _canonical(kind: str, value) -> str:
    if kind == "json_object":
        if value is not True:
            raise ValueError("structured_outputs.json_object must be true")
        return '{"type": "object"}'
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(value, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        return json.dumps(value, ensure_ascii=False)   # key order kept: it orders the output
    if kind == "choice":
        if not isinstance(value, (list, tuple)) or not value:
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        if len(value) > _MAX_CHOICES:
            raise ValueError(f"structured_outputs.choice accepts at most {_MAX_CHOICES} strings")
        if not all(isinstance(c, str) and c for c in value):
            raise ValueError("structured_outputs.choice must hold non-empty strings")
        return json.dumps(list(value), ensure_ascii=False)
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
    return value
