"""Tool calling over real HTTP with the official `openai` client, on a tiny random Llama that
speaks SmolLM2's tokenizer and plain ChatML template (so tools reach it as Hermes instructions
in the system prompt). Its text is noise: the calls come from the grammar (tool_choice named /
required) or from a structured_outputs choice that makes it write a Hermes call verbatim."""
import json

import jsonschema
import openai
import pytest
import requests

from tests.conftest import save_tiny_chat_llama
from tests.entrypoints.openai.conftest import LiveServer, start_engine
from tokenmill.entrypoints.openai.server import build_app

pytestmark = pytest.mark.e2e
MODEL = "tiny"
# Enums and no extra keys: the grammar alone ends the JSON, whatever the random weights say.
WEATHER_PARAMS = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                  "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                 "unit": {"type": "string", "enum": ["C", "F"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {
             "name": "get_time", "parameters": {
                 "type": "object", "additionalProperties": False, "required": ["zone"],
                 "properties": {"zone": {"type": "string", "enum": ["CET", "UTC"]}}}}}]
CHAT = [{"role": "user", "content": "What is the weather in Rome?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
HERMES_REPLY = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Rome", "unit": "C"}}\n</tool_call>')


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory, smollm2_path):
    """A tiny chat Llama with room for a tool prompt (2048 positions), served as "tiny"."""
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.models.loader import load_tokenizer

    path = save_tiny_chat_llama(tmp_path_factory.mktemp("tiny_tools"),
                                load_tokenizer(smollm2_path), max_position_embeddings=2048)
    engine = start_engine(lambda: LLM(model=path, num_kv_blocks=512, block_size=16,
                                      max_num_seqs=8, num_threads=1))
    with LiveServer(build_app(engine, MODEL, web_ui=False)) as live:
        yield live
    engine.stop()


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def chat(client, stream=False, **kwargs):
    kwargs = {"model": MODEL, "messages": CHAT, "temperature": 0, "max_tokens": 48, **kwargs}
    return client.chat.completions.create(stream=stream, **kwargs)


def joined_stream(chunks) -> tuple:
    """(content, [(name, arguments)], finish_reason, ids) put together from stream chunks."""
    content, calls, reasons = "", {}, []
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for part in choice.delta.tool_calls or []:
                call = calls.setdefault(part.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = part.id or call["id"]
                if part.function.name:
                    call["name"] = part.function.name
                call["arguments"] += part.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert len(reasons) == 1, reasons
    return (content or None, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())],
            reasons[0], [c["id"] for c in calls.values()])


def calls_of(message) -> list:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def test_named_tool_choice_stream_equals_non_stream(client):
    full = chat(client, tools=TOOLS, tool_choice=NAMED)
    message = full.choices[0].message
    assert len(message.tool_calls) == 1 and message.tool_calls[0].id.startswith("call_")
    content, calls, reason, ids = joined_stream(chat(client, True, tools=TOOLS, tool_choice=NAMED))
    assert (content, calls) == (message.content, calls_of(message))
    assert ids[0].startswith("call_")
    assert reason == full.choices[0].finish_reason


def test_named_tool_choice_is_a_valid_call(client):
    choice = chat(client, tools=TOOLS, tool_choice=NAMED).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (name, arguments), = calls_of(choice.message)
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMS)


@pytest.mark.parametrize("parallel", [False, None])
def test_required_tool_choice_gives_valid_calls(client, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    full = chat(client, tools=TOOLS, tool_choice="required", max_tokens=64, **extra).choices[0]
    calls = calls_of(full.message)
    assert calls and (len(calls) == 1 or parallel is None)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), schemas[name])
    streamed = joined_stream(chat(client, True, tools=TOOLS, tool_choice="required",
                                  max_tokens=64, **extra))
    assert streamed[:3] == (full.message.content, calls, full.finish_reason)


def test_auto_parses_a_hermes_call_streamed_and_not(client):
    forced = {"structured_outputs": {"choice": [HERMES_REPLY]}}
    full = chat(client, tools=TOOLS, extra_body=forced).choices[0]
    assert full.finish_reason == "tool_calls"
    assert full.message.content == "Let me check."
    assert calls_of(full.message) == [("get_weather", '{"city": "Rome", "unit": "C"}')]
    chunks = list(chat(client, True, tools=TOOLS, extra_body=forced))
    assert all("<" not in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    assert joined_stream(chunks)[:3] == ("Let me check.", calls_of(full.message), "tool_calls")


def test_tool_choice_none_and_no_tools_parse_nothing(client):
    forced = {"structured_outputs": {"choice": [HERMES_REPLY]}}
    for kwargs in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        choice = chat(client, extra_body=forced, **kwargs).choices[0]
        assert not choice.message.tool_calls and choice.finish_reason != "tool_calls"
        assert choice.message.content   # the text, whatever it is, comes back as content


def test_tools_reach_the_prompt(client):
    plain = chat(client, max_tokens=1).usage.prompt_tokens
    with_tools = chat(client, tools=TOOLS, max_tokens=1).usage.prompt_tokens
    assert with_tools > plain + 100   # the Hermes instructions and both schemas


@pytest.mark.parametrize("stream", [False, True])
def test_round_trip_call_result_answer(client, stream):
    first = chat(client, tools=TOOLS, tool_choice=NAMED)
    call = first.choices[0].message.tool_calls[0]
    messages = [*CHAT, first.choices[0].message,   # the client's own message object, as is
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    answer = chat(client, stream, messages=messages, tools=TOOLS, max_tokens=8)
    if stream:
        content, calls, reason, _ = joined_stream(answer)
    else:
        content, reason = answer.choices[0].message.content, answer.choices[0].finish_reason
        calls = calls_of(answer.choices[0].message)
        assert answer.usage.prompt_tokens > first.usage.prompt_tokens
    assert content and not calls and reason in ("stop", "length")


def post(server, body: dict):
    return requests.post(server.url + "/v1/chat/completions", timeout=60,
                         json={"model": MODEL, "messages": CHAT, "max_tokens": 2, **body})


def assert_400(r, param: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"], error
    assert ".py" not in error["message"] and "Traceback" not in error["message"]


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {}}]}]},
     "messages.0.tool_calls.0.function.name"),
])
def test_bad_tools_are_400(tiny_server, body, param):
    assert_400(post(tiny_server, body), param)


def test_a_tool_schema_the_grammar_cannot_compile_is_400_on_tools(tiny_server):
    # the grammar compiler is what refuses the schema
    bad = [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}}}]
    assert_400(post(tiny_server, {"tools": bad, "tool_choice": "required"}), "tools")
