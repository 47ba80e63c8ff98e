"""Tool-call parsers, alone: each format's calls and content, and the streaming contract — any
chunking of the text yields the same content and calls as the whole text, and a call's
marker never reaches the client as content."""
import json
import random

import pytest

from tokenmill.entrypoints.openai.mistral_tools import MistralToolParser
from tokenmill.entrypoints.openai.tool_parsers import (ContentParser, HermesToolParser,
                                                       Llama3JsonToolParser, NamedCallParser,
                                                       RequiredCallsParser, assemble,
                                                       merge_deltas, template_tool_format)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET"}}'


def whole(parser_cls, text: str, *args):
    parser = parser_cls(*args)
    return assemble(parser.feed(text) + parser.finish())


def chunked(parser_cls, text: str, sizes, *args):
    """Feed ``text`` in chunks of the given sizes (cycled); returns (content, calls, deltas)."""
    parser, deltas, pos, i = parser_cls(*args), [], 0, 0
    while pos < len(text):
        size = sizes[i % len(sizes)]
        deltas += parser.feed(text[pos:pos + size])
        pos, i = pos + size, i + 1
    deltas += parser.finish()
    return (*assemble(deltas), deltas)


def calls_of(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


HERMES_CASES = [
    # (text, content, [(name, arguments)])
    (f"<tool_call>\n{WEATHER}\n</tool_call>", None,
     [("get_weather", {"city": "Paris", "unit": "C"})]),
    (f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>", "Let me check.",
     [("get_weather", {"city": "Paris", "unit": "C"})]),
    (f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>\n", None,
     [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"zone": "CET"})]),
    # a model that stops right after the JSON, without closing the tag
    (f"<tool_call>\n{WEATHER}", None, [("get_weather", {"city": "Paris", "unit": "C"})]),
    ("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": </tool_call>",
     "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": </tool_call>", []),
    ('<tool_call>\n{"name": "get_weather", "argu', '<tool_call>\n{"name": "get_weather", "argu',
     []),
    ("The answer is 4 < 5, and <tool_ is not a tag.  ",
     "The answer is 4 < 5, and <tool_ is not a tag.  ", []),
    ("", "", []),
]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes_whole_text(text, content, calls):
    got_content, got_calls = whole(HermesToolParser, text)
    assert got_content == content
    assert calls_of(got_calls) == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got_calls)


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
@pytest.mark.parametrize("sizes", [[1], [2, 3], [7], [1, 11, 2, 5]])
def test_hermes_any_chunking_equals_whole_text(text, content, calls, sizes):
    got_content, got_calls, deltas = chunked(HermesToolParser, text, sizes)
    assert got_content == content
    assert calls_of(got_calls) == calls
    if calls:   # no piece of a marker was ever streamed as content
        streamed = "".join(d.get("content", "") for d in deltas)
        assert "<" not in streamed and "tool_call" not in streamed


def test_hermes_arguments_are_compact_json_strings_in_order():
    _, calls = whole(HermesToolParser, f"<tool_call>\n{WEATHER}\n</tool_call>")
    assert calls[0]["function"]["arguments"] == '{"city": "Paris", "unit": "C"}'


def test_hermes_streams_content_before_the_call_arrives():
    parser = HermesToolParser()
    assert parser.feed("Let me check") == [{"content": "Let me check"}]
    assert parser.feed(" the weather. <tool") == [{"content": " the weather."}]
    assert parser.feed("_call>\n" + WEATHER[:20]) == []
    deltas = parser.feed(WEATHER[20:] + "\n</tool_call>")
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas] == ["get_weather"]
    assert parser.finish() == [] and parser.num_calls == 1


LLAMA_CASES = [
    ('{"name": "get_time", "parameters": {"zone": "CET"}}', None, [("get_time", {"zone": "CET"})]),
    ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', None,
     [("get_time", {"zone": "CET"})]),
    ('{"name": "get_time", "parameters": {"zone": "CET"}}; {"name": "get_weather", '
     '"parameters": {"city": "Rome"}}', None,
     [("get_time", {"zone": "CET"}), ("get_weather", {"city": "Rome"})]),
    ("It is sunny in Rome.", "It is sunny in Rome.", []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "get_time", "parameters": {"zone": ',
     '{"name": "get_time", "parameters": {"zone": ', []),
    ("  <|py", "  <|py", []),
]


@pytest.mark.parametrize("text,content,calls", LLAMA_CASES)
@pytest.mark.parametrize("sizes", [[10_000], [1], [3, 5]])
def test_llama3_json(text, content, calls, sizes):
    got_content, got_calls, _ = chunked(Llama3JsonToolParser, text, sizes)
    assert got_content == content
    assert calls_of(got_calls) == calls


def test_llama3_plain_text_streams_at_once():
    parser = Llama3JsonToolParser()
    assert parser.feed("Hello") == [{"content": "Hello"}]
    assert parser.feed(" there") == [{"content": " there"}]


def test_named_call_streams_its_arguments_as_they_come():
    text = '{"city": "Paris"}'
    content, calls, deltas = chunked(NamedCallParser, text, [3], "get_weather")
    assert content is None and len(calls) == 1
    assert calls[0]["function"] == {"name": "get_weather", "arguments": text}
    assert deltas[0]["tool_calls"][0]["id"].startswith("call_")
    assert all("id" not in d["tool_calls"][0] for d in deltas[1:])
    # no text at all still returns the one call the request asked for
    assert whole(NamedCallParser, "", "f")[1][0]["function"] == {"name": "f", "arguments": ""}


REQUIRED = ('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
            '{"name": "get_time", "parameters": {"zone": "CET"}}]')


@pytest.mark.parametrize("sizes", [[1], [4], [len(REQUIRED)]])
def test_required_calls_each_element_is_a_call(sizes):
    content, calls, deltas = chunked(RequiredCallsParser, REQUIRED, sizes)
    assert content is None
    assert calls_of(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]


def test_required_calls_emits_a_call_as_soon_as_its_element_closes():
    parser = RequiredCallsParser()
    first = REQUIRED.index("},") + 1
    assert parser.feed(REQUIRED[:first - 1]) == []
    assert len(parser.feed(REQUIRED[first - 1:first])) == 1


@pytest.mark.parametrize("text", ["not json", '[{"name": 3}]', '[{"name": "f", "param'])
def test_required_calls_without_a_call_is_content(text):
    assert whole(RequiredCallsParser, text) == (text, [])


def test_content_parser_passes_text_through():
    assert whole(ContentParser, "a <tool_call> b") == ("a <tool_call> b", [])


def test_random_chunkings_of_a_long_hermes_message():
    text = ("Sure. " * 20 + f"<tool_call>\n{WEATHER}\n</tool_call>\n"
            + f"<tool_call>\n{TIME}\n</tool_call>")
    expected = whole(HermesToolParser, text)
    rng = random.Random(0)
    for _ in range(50):
        sizes = [rng.randint(1, 9) for _ in range(8)]
        content, calls, _ = chunked(HermesToolParser, text, sizes)
        assert (content, calls_of(calls)) == (expected[0], calls_of(expected[1]))


def test_merge_deltas_joins_fragments_of_one_call():
    parser = NamedCallParser("f")
    merged = merge_deltas(parser.feed('{"a"') + parser.feed(": 1}") + [{"content": ""}])
    assert merged["tool_calls"] == [{"index": 0, "id": merged["tool_calls"][0]["id"],
                                     "type": "function",
                                     "function": {"name": "f", "arguments": '{"a": 1}'}}]
    assert merge_deltas([]) == {}


QWEN_LIKE = "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}<tool_call>"
LLAMA_LIKE = ('{% for t in tools %}{{ t | tojson }}{% endfor %}<|python_tag|>'
              '{{- \'"parameters": \' }}ipython')


@pytest.mark.parametrize("template,fmt", [
    (QWEN_LIKE, "hermes"), (LLAMA_LIKE, "llama3_json"),
    ("{% for t in tools %}[TOOL_CALLS]{% endfor %}", "mistral"),
    ("{% for t in tools %}{{ t.function | tojson }}{% endfor %}", "unknown"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None), ("", None)])
def test_template_tool_format(template, fmt):
    assert template_tool_format(template) == fmt


MISTRAL_WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
MISTRAL_CASES = [
    # (text, content, [(name, arguments)])
    (f"[TOOL_CALLS] [{MISTRAL_WEATHER}]", None,
     [("get_weather", {"city": "Paris", "unit": "C"})]),
    (f"[TOOL_CALLS][{MISTRAL_WEATHER}, {TIME}]\n", None,
     [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"zone": "CET"})]),
    (f"Let me check. [TOOL_CALLS] [{MISTRAL_WEATHER}]", "Let me check.",
     [("get_weather", {"city": "Paris", "unit": "C"})]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "C"}', None,
     [("get_weather", {"city": "Paris", "unit": "C"})]),
    ('Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', "Sure.",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    # not calls after the marker: the marker and what follows are content
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": ]',
     '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": ]', []),
    ('[TOOL_CALLS] [{"name": 3}]', '[TOOL_CALLS] [{"name": 3}]', []),
    ("I use [TOOL_CALLS] for calls.", "I use [TOOL_CALLS] for calls.", []),
    ("[TOOL_CALLS]get weather[ARGS]{}", "[TOOL_CALLS]get weather[ARGS]{}", []),
    ("[TOOL_CALLS]f[ARGS]oops", "[TOOL_CALLS]f[ARGS]oops", []),
    ('[TOOL_CALLS][TOOL_CALLS]f[ARGS]{"a": 1}', "[TOOL_CALLS]", [("f", {"a": 1})]),
    ("[TOOL_CALLS]", "[TOOL_CALLS]", []),
    ("Ends in [TOOL_", "Ends in [TOOL_", []),
    ("", "", []),
]


@pytest.mark.parametrize("text,content,calls", MISTRAL_CASES)
def test_mistral_whole_text_with_9_character_ids(text, content, calls):
    got_content, got_calls = whole(MistralToolParser, text)
    assert (got_content, calls_of(got_calls)) == (content, calls)
    assert all(len(c["id"]) == 9 and c["id"].isalnum() and c["id"].isascii() for c in got_calls)
    assert len({c["id"] for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("text,content,calls", MISTRAL_CASES)
def test_mistral_every_split_equals_whole_text(text, content, calls):
    """Two chunks split anywhere, three split around the marker, one character at a time."""
    marker = max(text.find("[TOOL_CALLS]"), 0)
    splits = [[cut] for cut in range(len(text) + 1)]
    splits += [[a, b] for a in range(marker, marker + 13) for b in range(a, len(text) + 1)]
    splits.append(list(range(len(text) + 1)))
    for cuts in splits:
        bounds = [0, *cuts, len(text)]
        parser, deltas = MistralToolParser(), []
        for start, end in zip(bounds, bounds[1:]):
            deltas += parser.feed(text[start:end])
        deltas += parser.finish()
        got_content, got_calls = assemble(deltas)
        # content is the join of what streamed, so no piece of a call's marker ever did
        assert (got_content, calls_of(got_calls)) == (content, calls), cuts


def test_mistral_streams_content_then_each_call_when_whole():
    parser = MistralToolParser()
    assert parser.feed("Let me check") == [{"content": "Let me check"}]
    assert parser.feed(" the weather. [TOOL") == [{"content": " the weather."}]
    assert parser.feed("_CALLS]get_weather[ARGS]{\"city\": ") == []
    first = parser.feed('"Paris"}[TOOL_CALLS]get_ti')
    assert [d["tool_calls"][0]["function"]["name"] for d in first] == ["get_weather"]
    assert [d["tool_calls"][0]["index"] for d in parser.feed("me[ARGS]{}")] == [1]
    assert parser.finish() == [] and parser.num_calls == 2
