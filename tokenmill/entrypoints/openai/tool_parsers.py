"""Tool-call parsers: model text in, OpenAI chat deltas out, fed incrementally.

A delta is ``{"content": str}`` or ``{"tool_calls": [{"index", "id", "type", "function":
{"name", "arguments"}}]}`` (later fragments of a call carry only index and arguments).
The same machine serves streamed and non-streamed answers: a non-streamed answer is the whole
text fed at once, then ``finish()``, and its deltas put together by ``assemble``. So a stream's
argument fragments join to the non-streamed arguments by construction, whatever the chunking.

Each call is emitted whole (name and complete arguments) once its closing marker or closing
brace has arrived; only the forced single call of a named ``tool_choice`` streams its
arguments as they come, since the whole output is those arguments.

A parser takes ``call_id``, the maker of its calls' ids: templates that check the ids they are
sent back (Mistral's) get ids of their own shape. Mistral's format is in mistral_tools.
"""
from __future__ import annotations

import json
import uuid
from typing import Callable, Optional

_DECODER = json.JSONDecoder()


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def template_tool_format(chat_template: str) -> Optional[str]:
    """The call format a chat template teaches, read from its text: "hermes" (Hermes, Qwen2.5,
    Qwen3), "llama3_json", "mistral" (Mistral 7B v0.3, Mixtral-8x22B, Nemo, Small), "unknown"
    (it renders tools some other way), or None when the template ignores ``tools`` altogether."""
    if "tools" not in chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if '"parameters"' in chat_template and ("ipython" in chat_template
                                            or "<|python_tag|>" in chat_template):
        return "llama3_json"
    return "unknown"


class ContentParser:
    """No tool calls: every piece of text is content. The base of the parsers below."""

    def __init__(self, call_id: Callable[[], str] = new_call_id) -> None:
        self.num_calls = 0
        self._call_id = call_id

    def feed(self, text: str) -> list[dict]:
        return [{"content": text}] if text else []

    def finish(self) -> list[dict]:
        return []

    def _call(self, name: str, arguments: str) -> dict:
        """The first delta of a new call (its index is the number of calls so far)."""
        delta = {"tool_calls": [{"index": self.num_calls, "id": self._call_id(), "type": "function",
                                 "function": {"name": name, "arguments": arguments}}]}
        self.num_calls += 1
        return delta


class CallsInTextParser(ContentParser):
    """Content with marked calls among it. Whitespace next to a call only separates it from the
    text and is dropped; so trailing whitespace is held until the next text shows what it
    borders, and at the end it is content only in a message without calls."""

    def __init__(self, call_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(call_id)
        self._held_space = ""
        self._after_call = False

    def _spaced_call(self, name: str, arguments: str) -> dict:
        self._held_space, self._after_call = "", True
        return self._call(name, arguments)

    def _content(self, text: str) -> list[dict]:
        text = self._held_space + text
        if self._after_call:
            text = text.lstrip()
        core = text.rstrip()
        self._held_space = text[len(core):]
        if not core:
            return []
        self._after_call = False
        return [{"content": core}]

    def _end_content(self) -> list[dict]:
        held, self._held_space = self._held_space, ""
        return [{"content": held}] if self.num_calls == 0 and held else []


class HermesToolParser(CallsInTextParser):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, any number of them;
    text outside the tags is content. Text that may be the start of the tag is held back, so the
    tag never reaches a client as content."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, call_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(call_id)
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> list[dict]:
        self._buffer += text
        out: list[dict] = []
        while True:
            marker = self.END if self._in_call else self.START
            at = self._buffer.find(marker)
            if at < 0:
                break
            before, self._buffer = self._buffer[:at], self._buffer[at + len(marker):]
            out += self._block(before, closed=True) if self._in_call else self._content(before)
            self._in_call = not self._in_call
        if not self._in_call:
            split = len(self._buffer) - partial_marker_len(self._buffer, self.START)
            ready, self._buffer = self._buffer[:split], self._buffer[split:]
            out += self._content(ready)
        return out

    def finish(self) -> list[dict]:
        # A model may stop right after the JSON without closing the tag: still a call.
        rest, self._buffer = self._buffer, ""
        out = self._block(rest, closed=False) if self._in_call else self._content(rest)
        self._in_call = False
        return out + self._end_content()

    def _block(self, body: str, closed: bool) -> list[dict]:
        call = parse_call(body, "arguments")
        if call is None:   # not a call after all: the tags and all are content
            return self._content(self.START + body + (self.END if closed else ""))
        return [self._spaced_call(*call)]


class Llama3JsonToolParser(ContentParser):
    """Llama 3.x JSON calls: the whole message is ``{"name": ..., "parameters": {...}}``
    (several joined by ";"), optionally after ``<|python_tag|>``. A message that starts like
    that is held to the end, then either all of it is calls or all of it is content."""

    TAG = "<|python_tag|>"

    def __init__(self, call_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(call_id)
        self._buffer = ""
        self._holding: Optional[bool] = None   # None until the first visible text decides

    def feed(self, text: str) -> list[dict]:
        if self._holding is False:
            return super().feed(text)
        self._buffer += text
        if self._holding:
            return []
        head = self._buffer.lstrip()
        if not head or (self.TAG.startswith(head) and head != self.TAG):
            return []
        self._holding = head.startswith(("{", self.TAG))
        if self._holding:
            return []
        text, self._buffer = self._buffer, ""
        return super().feed(text)

    def finish(self) -> list[dict]:
        text, self._buffer = self._buffer, ""
        calls = parse_llama3_calls(text) if self._holding else None
        if calls is None:
            return super().feed(text)
        return [self._call(name, arguments) for name, arguments in calls]


class NamedCallParser(ContentParser):
    """``tool_choice`` names one function: the grammar makes the whole output that function's
    arguments, so every piece of text is an argument fragment of call 0."""

    def __init__(self, name: str, call_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(call_id)
        self._name = name

    def feed(self, text: str) -> list[dict]:
        if self.num_calls == 0:
            return [self._call(self._name, text)]
        return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else []

    def finish(self) -> list[dict]:
        return self.feed("") if self.num_calls == 0 else []


class RequiredCallsParser(ContentParser):
    """``tool_choice`` "required": the grammar makes the output a JSON array of
    ``{"name": ..., "parameters": {...}}``; each element is a call once it is complete. Text
    that holds no call at all (no grammar, or a cut-off array) comes back as content."""

    def __init__(self, call_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(call_id)
        self._text = ""
        self._pos: Optional[int] = None   # where the next element may start, once "[" is seen
        self._broken = False

    def feed(self, text: str) -> list[dict]:
        self._text += text
        out: list[dict] = []
        if self._pos is None:
            head = self._text.lstrip()
            if not head:
                return out
            self._broken = not head.startswith("[")
            self._pos = len(self._text) - len(head) + 1
        while not self._broken:
            start = _skip(self._text, self._pos, " \t\r\n,")
            if start >= len(self._text) or self._text[start] == "]":
                break
            try:
                element, end = _DECODER.raw_decode(self._text, start)
            except ValueError:   # incomplete so far; finish() settles a broken one
                break
            call = parse_call(element, "parameters")
            self._broken = call is None
            if call is not None:
                out.append(self._call(*call))
                self._pos = end
        return out

    def finish(self) -> list[dict]:
        return [{"content": self._text}] if self.num_calls == 0 and self._text else []


def parse_call(value, arguments_key: str) -> Optional[tuple[str, str]]:
    """(name, arguments as a JSON string) from ``{"name": ..., <arguments_key>: {...}}`` given
    as a dict or as JSON text; None when it is not one call."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    other_key = "parameters" if arguments_key == "arguments" else "arguments"
    arguments = value.get(arguments_key, value.get(other_key, {}))
    if isinstance(arguments, str):   # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def parse_llama3_calls(text: str) -> Optional[list[tuple[str, str]]]:
    """Calls of a whole Llama 3 message (``{...}; {...}``), or None if any part is not one."""
    text = text.strip()
    if text.startswith(Llama3JsonToolParser.TAG):
        text = text[len(Llama3JsonToolParser.TAG):]
    calls, pos = [], _skip(text, 0, " \t\r\n")
    while pos < len(text):
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except ValueError:
            return None
        call = parse_call(value, "parameters")
        if call is None:
            return None
        calls.append(call)
        pos = _skip(text, pos, " \t\r\n")
        if pos < len(text) and text[pos] != ";":
            return None
        pos = _skip(text, pos + 1, " \t\r\n")
    return calls or None


def assemble(deltas: list[dict]) -> tuple[Optional[str], list[dict]]:
    """(content, tool_calls) of a whole message from its deltas; content is None when the
    message is only calls."""
    content, calls = [], []
    for delta in deltas:
        content.append(delta.get("content", ""))
        for part in delta.get("tool_calls", ()):
            if part["index"] == len(calls):
                calls.append({"id": part["id"], "type": "function",
                              "function": {"name": part["function"]["name"], "arguments": ""}})
            calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]
    text = "".join(content)
    return (text or None) if calls else text, calls


def merge_deltas(deltas: list[dict]) -> dict:
    """One chunk's delta from the deltas of one engine step (fragments of one call joined)."""
    merged: dict = {}
    for delta in deltas:
        if "content" in delta:
            merged["content"] = merged.get("content", "") + delta["content"]
        for part in delta.get("tool_calls", ()):
            calls = merged.setdefault("tool_calls", [])
            if calls and calls[-1]["index"] == part["index"]:
                last = calls[-1]
                last["function"] = dict(last["function"], arguments=last["function"]["arguments"]
                                        + part["function"]["arguments"])
            else:
                calls.append(dict(part))
    return merged


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos
