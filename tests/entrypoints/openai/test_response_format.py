"""response_format and structured_outputs / guided_* (both routes) over real HTTP, on the
tiny random chat Llama of test_tool_calls: its text is noise, so whatever shape the output has
comes from the grammar."""
import json
from typing import Literal

import openai
import pytest
import requests
from pydantic import BaseModel

from tests.entrypoints.openai.test_tool_calls import tiny_server  # noqa: F401 (fixture)

pytestmark = pytest.mark.e2e
MODEL = "tiny"
CHAT = [{"role": "user", "content": "Weather in Rome, as JSON."}]


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]
    unit: Literal["C", "F"]
    sunny: bool


@pytest.fixture(scope="module")
def client(tiny_server):  # noqa: F811 (the fixture imported above)
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def test_parse_with_a_pydantic_model_returns_the_object(client):
    completion = client.beta.chat.completions.parse(model=MODEL, messages=CHAT, temperature=0,
                                                    max_tokens=48, response_format=Weather)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Weather)
    assert Weather.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_schema_stream_equals_non_stream(client):
    schema = {"type": "json_schema", "json_schema": {"name": "weather", "strict": True,
                                                     "schema": Weather.model_json_schema()}}
    kwargs = dict(model=MODEL, messages=CHAT, temperature=0, max_tokens=48, response_format=schema)
    full = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        full.message.content


def test_json_object_starts_an_object(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=16,
                                          response_format={"type": "json_object"})
    content = full.choices[0].message.content
    assert content.startswith("{")
    if full.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_text_format_is_unconstrained(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=4,
                                          response_format={"type": "text"})
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.completion_tokens >= 1


@pytest.mark.parametrize("extra,check", [
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-c]{2}"}},
     lambda t: len(t) == 6 and t[:3].isdigit() and t[3] == "-" and set(t[4:]) <= set("abc")),
    ({"guided_regex": "(cat|dog)s?"}, lambda t: t in ("cat", "cats", "dog", "dogs")),
    ({"guided_json": {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"],
                      "additionalProperties": False}},
     lambda t: json.loads(t)["n"] in (1, 2)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"n": {"enum": [3, 4]}}, "required": ["n"],
        "additionalProperties": False}}}},
     lambda t: json.loads(t)["n"] in (3, 4)),
])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_structured_outputs_on_both_routes(client, route, extra, check):
    if route == "chat":
        out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16,
                                             temperature=0, extra_body=extra)
        text = out.choices[0].message.content
    else:
        out = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=16,
                                        temperature=0, extra_body=extra)
        text = out.choices[0].text
    assert out.choices[0].finish_reason == "stop", text
    assert check(text), text


def post(server, route: str, body: dict):
    url = server.url + ("/v1/chat/completions" if route == "chat" else "/v1/completions")
    base = {"messages": CHAT} if route == "chat" else {"prompt": "Answer:"}
    return requests.post(url, json={"model": MODEL, "max_tokens": 2, **base, **body}, timeout=60)


GOOD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}
CASES = [
    ("chat", {"response_format": {"type": "xml"}}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "w"}}},
     "response_format"),
    ("chat", {"response_format": "json"}, "response_format"),
    ("chat", {"response_format": GOOD_SCHEMA, "structured_outputs": {"regex": "a+"}},
     "response_format"),
    ("chat", {"structured_outputs": {"regex": "a+"}, "guided_choice": ["a"]}, "guided_choice"),
    ("completions", {"structured_outputs": {"regex": "a+", "choice": ["a"]}},
     "structured_outputs"),
    ("completions", {"structured_outputs": {"pattern": "a+"}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"choice": []}}, "structured_outputs"),
    ("completions", {"structured_outputs": "a+"}, "structured_outputs"),
    ("completions", {"guided_json": "{not json"}, "guided_json"),
    # refused by the grammar compiler
    ("completions", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "schema": {"type": "object", "properties": {"x": {"type": "nope"}}}}}},
     "response_format"),
    ("completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "schema": {"type": "nope"}}}}, "response_format"),
    ("completions", {"response_format": {"type": "xml"}}, "response_format"),
]


@pytest.mark.parametrize("route,body,param", CASES,
                         ids=[f"{r}-{json.dumps(b)[:48]}" for r, b, _ in CASES])
def test_bad_constraint_is_400_naming_the_field(tiny_server, route, body, param):  # noqa: F811
    r = post(tiny_server, route, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"], error
    assert ".py" not in error["message"] and "Traceback" not in error["message"]
    if "nope" in json.dumps(body) or "unclosed" in json.dumps(body):   # the compiler's words
        assert error["message"].startswith(param), error     # name the field sent
