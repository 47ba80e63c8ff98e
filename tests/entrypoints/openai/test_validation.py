"""The request-validation matrix of TESTING.md: every bad parameter is a 400 in OpenAI's shape
with ``param`` set (never 422 / 500), no error body leaks internals, and a fixed canary request
answers the same before and after each case."""
import json

import pytest
import requests

from tests.entrypoints.openai.conftest import MODEL_NAME

pytestmark = pytest.mark.e2e
BIG = 2**64
CANARY = {"model": MODEL_NAME, "prompt": "One, two, three,", "max_tokens": 4, "temperature": 0}
COMPLETION = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

# (route, changes to the base body, expected param)
CASES = [
    ("completions", {"n": 0}, "n"), ("completions", {"n": -1}, "n"),
    ("completions", {"n": 10**9}, "n"),
    ("completions", {"max_tokens": 0}, "max_tokens"), ("completions", {"max_tokens": -1}, "max_tokens"),
    ("completions", {"max_tokens": BIG}, "max_tokens"),
    ("completions", {"logprobs": -1}, "logprobs"), ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": BIG}, "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 10**6}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat", {"n": 0}, "n"),
    ("completions", {"temperature": -1}, "temperature"),
    ("completions", {"top_p": 0}, "top_p"), ("completions", {"top_p": 1.5}, "top_p"),
    ("completions", {"top_p": -0.5}, "top_p"),
    ("completions", {"presence_penalty": 3}, "presence_penalty"),
    ("completions", {"seed": 2**63}, "seed"), ("completions", {"seed": -(2**63) - 1}, "seed"),
    ("completions", {"stop": ["x"] * 1000}, "stop"),
    ("completions", {"stop": [""]}, "stop"),
    ("completions", {"prompt": ""}, "prompt"), ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [10**7]}, "prompt"),
    ("completions", {"logit_bias": {"9999999": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": 1000}}, "logit_bias"),
    ("completions", {"stop_token_ids": [9999999]}, "stop_token_ids"),
    ("completions", {"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "no spaces allowed"}}]}, "tools"),
]


def _url(server, route):
    return server.url + ("/v1/chat/completions" if route == "chat" else "/v1/completions")


def _canary(server) -> str:
    r = requests.post(server.url + "/v1/completions", json=CANARY, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def canary_text(server):
    return _canary(server)


def assert_openai_error(r, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    for leak in ("Traceback", 'File "', ".py", "0x"):
        assert leak not in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("route,changes,param", CASES,
                         ids=[f"{r}-{json.dumps(c)[:40]}" for r, c, _ in CASES])
def test_bad_parameter_is_400_with_param(server, canary_text, route, changes, param):
    body = dict(CHAT if route == "chat" else COMPLETION, **changes)
    r = requests.post(_url(server, route), json=body, timeout=60)
    assert_openai_error(r, 400, param)
    assert _canary(server) == canary_text


@pytest.mark.parametrize("raw", ['{"prompt": "x", "temperature": NaN}',
                                 '{"prompt": "x", "temperature": Infinity}'])
def test_non_finite_temperature(server, canary_text, raw):
    r = requests.post(server.url + "/v1/completions", data=raw, timeout=30,
                      headers={"content-type": "application/json"})
    assert_openai_error(r, 400, "temperature")
    assert _canary(server) == canary_text


@pytest.mark.parametrize("raw", ["[1, 2]", '"text"', "5", "null", "{not json", ""])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_non_object_body(server, route, raw):
    r = requests.post(_url(server, route), data=raw, timeout=30,
                      headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


def test_prompt_longer_than_max_model_len(server, canary_text):
    ids = list(range(100, 1100))            # 1000 tokens + the check needs room: 1024 limit
    r = requests.post(server.url + "/v1/completions", timeout=60,
                      json=dict(COMPLETION, prompt=ids + ids[:100]))
    err = assert_openai_error(r, 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    assert "1100" in err["message"] and "1024" in err["message"]
    long_text = "hello " * 1500
    r = requests.post(server.url + "/v1/chat/completions", timeout=60,
                      json=dict(CHAT, messages=[{"role": "user", "content": long_text}]))
    err = assert_openai_error(r, 400, "messages")
    assert err["code"] == "context_length_exceeded"
    assert _canary(server) == canary_text


def test_unknown_model_is_404(server):
    r = requests.post(server.url + "/v1/completions", json=dict(COMPLETION, model="nope"),
                      timeout=30)
    assert assert_openai_error(r, 404, "model")["code"] == "model_not_found"


def test_unknown_route_and_method(server):
    assert_openai_error(requests.get(server.url + "/v1/nothing", timeout=10), 404)
    assert_openai_error(requests.get(server.url + "/v1/completions", timeout=10), 405)


def test_oversized_body_is_413(server, canary_text):
    big = "x" * (9 * 1024 * 1024)
    r = requests.post(server.url + "/v1/completions", json=dict(COMPLETION, prompt=big),
                      timeout=60)
    assert_openai_error(r, 413)

    def chunks():   # no Content-Length: the limit must hold on a chunked upload too
        for _ in range(10):
            yield b"x" * (1024 * 1024)
    r = requests.post(server.url + "/v1/completions", data=chunks(), timeout=60,
                      headers={"content-type": "application/json"})
    assert_openai_error(r, 413)
    assert _canary(server) == canary_text


def test_logprobs_zero_is_valid(server):
    """0 is a valid top-k (the chosen token's logprob only), as in OpenAI's API."""
    r = requests.post(server.url + "/v1/completions", json=dict(COMPLETION, logprobs=0), timeout=60)
    assert r.status_code == 200
    lps = r.json()["choices"][0]["logprobs"]
    assert len(lps["tokens"]) == 2 and lps["top_logprobs"] == [{}, {}]
