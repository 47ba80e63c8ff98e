"""Hostile text and templates over real HTTP (issue 23). A chat template from the model files
that reaches for Python internals or files, or runs away, is a 400 and the engine keeps
serving; 1 MB prompts are a 400 naming the context limit and bodies past the limit a 413;
control characters and lone surrogates anywhere in a request work or are a 400, never a 500;
characters split across byte tokens never stream as U+FFFD and the deltas join to the text."""
import json
import shutil
import threading

import pytest
import requests

from tests.entrypoints.openai.conftest import LiveServer, start_tiny_engine, wait_idle
from tokenmill.entrypoints.openai.server import build_app
from tokenmill.models.loader.gguf_tokenizer import byte_alphabet

pytestmark = pytest.mark.e2e

# The model's own template, behind probes that run an attack when the first message asks.
HOSTILE = """{%- set probe = messages[0]['content'] -%}
{%- if probe == 'ATTACK attr' -%}{{ ''.__class__.__mro__[1].__subclasses__() }}
{%- elif probe == 'ATTACK file' -%}{% include '/etc/passwd' %}
{%- elif probe == 'ATTACK loop' -%}
{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}
{%- elif probe == 'ATTACK bomb' -%}{{ 'x' * 10**9 }}
{%- elif probe == 'ATTACK recursion' -%}{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}
{%- elif probe == 'ATTACK output' -%}
{% for i in range(100000) %}{% for j in range(100000) %}{{ probe * 1000 }}{% endfor %}{% endfor %}
{%- elif probe == 'ATTACK raise' -%}{{ raise_exception('Conversation roles must alternate') }}
{%- else -%}CHATML{%- endif -%}"""
ATTACKS = {"attr": "tried to access attribute '__class__' of a 'str' object",
           "file": "tried to load the template '/etc/passwd'; chat templates cannot include",
           "loop": "ran more than 1000000 loop iterations",
           "bomb": "tried to build a string of 1000000000 characters",
           "recursion": "recursed too deeply",
           "output": "output exceeded 16777216 characters",
           "raise": "Conversation roles must alternate"}
CANARY = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
MEGABYTE = "word " * 210_000


@pytest.fixture(scope="module")
def hostile_engine(tiny_chat_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile_template") / "model"
    shutil.copytree(tiny_chat_model_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = HOSTILE.replace("CHATML", config["chat_template"])
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    engine = start_tiny_engine(str(path))
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def live(hostile_engine):
    with LiveServer(build_app(hostile_engine, "tiny")) as server:
        yield server


@pytest.fixture(scope="module")
def canary_text(live):
    return _chat(live, CANARY)["choices"][0]["message"]["content"]


def _post(live, path: str, body=None, raw=None, timeout=120) -> requests.Response:
    if raw is not None:
        return requests.post(live.url + path, data=raw, timeout=timeout,
                             headers={"content-type": "application/json"})
    return requests.post(live.url + path, json=body, timeout=timeout)


def _chat(live, body) -> dict:
    r = _post(live, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def _error(r: requests.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert "Traceback" not in error["message"] and "/work/" not in error["message"]
    return error


def _still_serving(live, canary_text) -> None:
    assert _chat(live, CANARY)["choices"][0]["message"]["content"] == canary_text


@pytest.mark.parametrize("attack", ATTACKS)
def test_hostile_chat_template_is_a_400(live, canary_text, attack):
    body = dict(CANARY, messages=[{"role": "user", "content": f"ATTACK {attack}"}])
    error = _error(_post(live, "/v1/chat/completions", body))
    assert ATTACKS[attack] in error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages"
    assert ATTACKS[attack] in _error(_post(live, "/tokenize", body))["message"]
    _still_serving(live, canary_text)


def test_runaway_template_does_not_stop_other_requests(live):
    body = {"prompt": [1, 2, 3], "max_tokens": 40, "ignore_eos": True, "stream": True}
    with requests.post(live.url + "/v1/completions", json=body, stream=True, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith(b"data: {"))   # it is decoding
        attack = dict(CANARY, messages=[{"role": "user", "content": "ATTACK loop"}])
        assert _post(live, "/v1/chat/completions", attack).status_code == 400
        rest = [line for line in lines if line.startswith(b"data: ")]
    assert rest[-1] == b"data: [DONE]" and not any(b'"error"' in line for line in rest)


def test_megabyte_text_prompts_are_a_400_naming_the_context_limit(live, canary_text):
    for path, body, param in (
            ("/v1/completions", {"prompt": MEGABYTE, "max_tokens": 2}, "prompt"),
            ("/v1/chat/completions", dict(CANARY, messages=[{"role": "user",
                                                             "content": MEGABYTE}]), "messages")):
        error = _error(_post(live, path, body))
        assert error["code"] == "context_length_exceeded" and error["param"] == param
        assert "max_model_len is 64" in error["message"] and "2100" in error["message"]
    _still_serving(live, canary_text)


def test_megabyte_token_id_prompt_is_a_400(live, canary_text):
    body = {"prompt": [1000 + i % 9000 for i in range(200_000)], "max_tokens": 2}
    assert len(json.dumps(body)) > 1_000_000
    error = _error(_post(live, "/v1/completions", body))
    assert error["code"] == "context_length_exceeded"
    assert "200000 tokens" in error["message"] and "max_model_len is 64" in error["message"]
    _still_serving(live, canary_text)


def test_body_past_the_limit_is_a_413(live, canary_text):
    raw = json.dumps({"prompt": "x" * (8 * 2**20)})   # 8 MiB of prompt: past 8 MiB of body
    error = _error(_post(live, "/v1/completions", raw=raw), 413)
    assert error["message"] == "request body is larger than 8388608 bytes"
    _still_serving(live, canary_text)


CONTROLS = ["\x00", "\x1b[31m", "\r", "\r\n", "\u2028", "\u2029", "\ufeff", "\x7f", "\ufffe",
            "\U0010ffff", "\t\x0b\x0c"]


@pytest.mark.parametrize("char", CONTROLS, ids=[repr(c) for c in CONTROLS])
def test_control_characters_work(live, char):
    text = f"a{char}b"
    r = _post(live, "/v1/completions", {"prompt": text, "max_tokens": 3, "stop": [char, "x" + char],
                                        "echo": True, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith(text)
    body = dict(CANARY, stop=[char], messages=[{"role": "system", "content": char},
                                               {"role": "user", "content": text}])
    assert _post(live, "/v1/chat/completions", body).status_code == 200
    streamed = _post(live, "/v1/chat/completions", dict(body, stream=True))
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    history = body["messages"] + [   # rendered only: longer than the tiny model's 64 positions
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1",
             "function": {"name": f"f{char}", "arguments": json.dumps({char: char})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": char}]
    assert _post(live, "/tokenize", {"messages": history}).json()["count"] > 20
    tools = [{"type": "function", "function": {"name": f"f{char}"}}]
    error = _error(_post(live, "/v1/chat/completions", dict(CANARY, tools=tools)))
    assert error["param"] == "tools"
    tokens = _post(live, "/tokenize", {"prompt": text}).json()["tokens"]
    assert _post(live, "/detokenize", {"tokens": tokens}).json()["prompt"].endswith(text)


# Raw JSON: a lone surrogate in each place a request carries text.
SURROGATES = {
    "prompt": ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}'),
    "prompt-list": ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}'),
    "stop": ("/v1/completions", '{"prompt": "ok", "max_tokens": 2, "stop": ["\\ud83c"]}'),
    "user": ("/v1/completions", '{"prompt": "ok", "max_tokens": 2, "user": "\\ud800"}'),
    "logit_bias": ("/v1/completions", '{"prompt": "ok", "max_tokens": 2, '
                                      '"logit_bias": {"\\ud800": 1}}'),
    "structured_outputs": ("/v1/completions", '{"prompt": "ok", "max_tokens": 2, '
                                              '"structured_outputs": {"regex": "\\ud800"}}'),
    "messages": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    "messages-parts": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": '
                                               '[{"type": "text", "text": "\\udc00"}]}]}'),
    "messages-tool-call": ("/v1/chat/completions", '{"messages": [{"role": "assistant", '
                           '"tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '
                           '"{\\"a\\": \\"\\ud800\\"}"}}]}]}'),
    "tools": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "tools": '
                                      '[{"type": "function", "function": {"name": "f\\ud800"}}]}'),
    "tool_choice": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
                    '"tool_choice": {"type": "function", "function": {"name": "\\ud800"}}}'),
    "response_format": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
                        '"response_format": {"type": "json_schema", "json_schema": {"name": "x", '
                        '"schema": {"enum": ["\\ud800"]}}}}'),
    "tokenize": ("/tokenize", '{"prompt": "\\ud800"}'),
    "input": ("/v1/embeddings", '{"input": "\\ud800"}'),
}


@pytest.mark.parametrize("case", SURROGATES)
def test_lone_surrogates_are_a_400_naming_the_field(live, canary_text, case):
    path, raw = SURROGATES[case]
    error = _error(_post(live, path, raw=raw))
    assert "lone surrogate" in error["message"]
    assert error["param"] == case.split("-")[0].replace("tokenize", "prompt")
    _still_serving(live, canary_text)


def test_surrogate_pairs_and_invalid_utf8_bodies(live):
    pair = _post(live, "/tokenize", raw='{"prompt": "\\ud83c\\udf89"}')   # JSON's spelling of 🎉
    assert pair.status_code == 200 and pair.json()["count"] >= 1
    _error(_post(live, "/v1/completions", raw=b'{"prompt": "\xff\xfe", "max_tokens": 2}'))


def _stream_text(live, path: str, body: dict) -> list[str]:
    r = _post(live, path, dict(body, stream=True))
    assert r.status_code == 200
    deltas = []
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                delta = choice.get("text", choice.get("delta", {}).get("content"))
                deltas.append(delta or "")
    return deltas


@pytest.mark.parametrize("target", ["🎉日本🎉", "日本語のテキスト", "é👩‍💻Ω"])
def test_characters_split_across_byte_tokens_stream_whole(live, hostile_engine, target):
    """The choice grammar makes the random model spell the target, mostly in byte tokens."""
    tok = hostile_engine.tokenizer
    body = {"prompt": tok.encode("Say:", add_special_tokens=False), "max_tokens": 40,
            "temperature": 0, "structured_outputs": {"choice": [target]}, "logprobs": 0}
    whole = _post(live, "/v1/completions", body).json()["choices"][0]
    assert whole["text"] == target
    assert "\ufffd" in "".join(whole["logprobs"]["tokens"])   # some token held half a character
    deltas = _stream_text(live, "/v1/completions", body)
    assert "".join(deltas) == target and not any("\ufffd" in d for d in deltas)
    chat = dict(CANARY, max_tokens=40, structured_outputs={"choice": [target]})
    deltas = _stream_text(live, "/v1/chat/completions", chat)
    assert "".join(deltas) == target and not any("\ufffd" in d for d in deltas)


def test_invalid_utf8_output_is_replacement_characters(live, hostile_engine):
    """Pushed toward a lone continuation byte, the model writes invalid UTF-8: each such byte
    is one U+FFFD, the same streamed or whole, every time."""
    tok = hostile_engine.tokenizer
    lone = tok.token_to_id(byte_alphabet()[0x80])
    body = {"prompt": [1, 2, 3], "max_tokens": 20, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(lone): 100}}
    whole = _post(live, "/v1/completions", body).json()["choices"][0]["text"]
    assert whole == "\ufffd" * 20
    assert "".join(_stream_text(live, "/v1/completions", body)) == whole
    assert _post(live, "/v1/completions", body).json()["choices"][0]["text"] == whole


def test_nothing_left_behind(live, hostile_engine):
    state = wait_idle(hostile_engine)
    assert state["unfinished"] == 0 and state["free_blocks"] == state["total_blocks"]
