"""Mistral's tool calls: the parser of its output, and the call ids its chat templates demand.

Two output forms follow the ``[TOOL_CALLS]`` marker: a JSON array of ``{"name", "arguments"}``
(Mistral 7B v0.3, Mixtral-8x22B: ``[TOOL_CALLS] [{...}, {...}]``) and, from newer tokenizers,
``name[ARGS]{...}`` with the marker before each call. Both markers are special tokens, so the
text must be decoded with them (ToolPlan.keeps_special_tokens).

Mistral's templates raise unless every ``tool_call.id`` and ``tool_call_id`` is 9 characters
(alphanumeric, mistral-common says): our calls get such ids, and a client's own ids are mapped to
such ids, the same one each time, before the template sees them.
"""
from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
from typing import Callable, Optional

from tokenmill.entrypoints.openai.tool_parsers import (CallsInTextParser, parse_call,
                                                       partial_marker_len)

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ALNUM = string.ascii_letters + string.digits
_ID = re.compile(r"[a-zA-Z0-9]{9}")
_NAME = re.compile(r"[a-zA-Z0-9_-]{0,64}")   # tool_choice's name rule; empty while it streams
_DECODER = json.JSONDecoder()

# What follows the marker: None while more text may still make calls; ([], 0) when it is not
# calls; else (calls as (name, arguments) pairs, where the calls end).
_Found = Optional[tuple[list, int]]


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def mistral_id_for(call_id):
    """A client's id as a Mistral template accepts it: itself when it is 9 alphanumerics, else
    9 base-62 digits of its hash, so a call and the result that names it still match."""
    if not isinstance(call_id, str) or _ID.fullmatch(call_id):
        return call_id   # a missing id stays missing: the client's mistake, the template says so
    number = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    digits = []
    for _ in range(9):
        number, digit = divmod(number, 62)
        digits.append(_ALNUM[digit])
    return "".join(digits)


def with_mistral_ids(dicts: list[dict]) -> list[dict]:
    """Template message dicts with every call id as mistral_id_for makes it."""
    out = []
    for d in dicts:
        d = dict(d)
        if d.get("tool_calls"):
            d["tool_calls"] = [dict(c, id=mistral_id_for(c.get("id"))) for c in d["tool_calls"]]
        if "tool_call_id" in d:
            d["tool_call_id"] = mistral_id_for(d["tool_call_id"])
        out.append(d)
    return out


class MistralToolParser(CallsInTextParser):
    """Text before ``[TOOL_CALLS]`` is content, and text that may be the start of the marker is
    held back. What follows the marker is held until it is whole calls (then the text after
    them is text again) or cannot be (then the marker and all after it are content). Whether
    it can be is read off the text so far only, so any chunking decides the same way."""

    def __init__(self, call_id: Callable[[], str] = mistral_call_id) -> None:
        super().__init__(call_id)
        self._buffer = ""
        self._in_calls = False

    def feed(self, text: str) -> list[dict]:
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> list[dict]:
        return self._run(final=True) + self._end_content()

    def _run(self, final: bool) -> list[dict]:
        out: list[dict] = []
        while self._in_calls or MARKER in self._buffer:
            if not self._in_calls:
                at = self._buffer.find(MARKER)
                out += self._content(self._buffer[:at])
                self._buffer, self._in_calls = self._buffer[at + len(MARKER):], True
            step = self._after_marker(final)
            if step is None:
                return out
            out += step
        split = len(self._buffer) - (0 if final else partial_marker_len(self._buffer, MARKER))
        ready, self._buffer = self._buffer[:split], self._buffer[split:]
        return out + self._content(ready)

    def _after_marker(self, final: bool) -> Optional[list[dict]]:
        head = self._buffer.lstrip()
        found = (_json_calls if head[:1] in ("[", "{") else _named_call)(head)
        if found is None and not final:
            return None
        calls, end = found or ([], 0)
        self._in_calls = False
        if not calls:   # not calls after all: the marker is content, what follows is text
            return self._content(MARKER)
        self._buffer = head[end:]
        return [self._spaced_call(*call) for call in calls]


def _json_calls(head: str) -> _Found:
    """``[{"name": ..., "arguments": {...}}, ...]`` (or one such object)."""
    try:
        value, end = _DECODER.raw_decode(head)
    except ValueError:
        # Incomplete so far, unless it already starts unlike a list of objects (or an object).
        second = head[1:].lstrip()[:1]
        return None if second in ("", "{" if head[0] == "[" else '"') else ([], 0)
    calls = [parse_call(element, "arguments")
             for element in (value if isinstance(value, list) else [value])]
    return (calls, end) if calls and None not in calls else ([], 0)


def _named_call(head: str) -> _Found:
    """``name[ARGS]{...}``."""
    at = head.find(ARGS)
    if at < 0:   # a name so far, perhaps followed by the start of [ARGS]?
        name = head[:len(head) - partial_marker_len(head, ARGS)]
        return None if _NAME.fullmatch(name) else ([], 0)
    name, arguments = head[:at], head[at + len(ARGS):].lstrip()
    if not name or not _NAME.fullmatch(name) or arguments[:1] not in ("", "{"):
        return [], 0
    start = len(head) - len(arguments)
    try:
        value, end = _DECODER.raw_decode(head, start)
    except ValueError:
        return None
    call = parse_call({"name": name, "arguments": value}, "arguments")
    return ([call], end) if call else ([], 0)
