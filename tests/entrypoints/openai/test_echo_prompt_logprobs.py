"""/v1/completions ``echo`` (text, logprobs, streaming, max_tokens 0) and the vLLM extra
``prompt_logprobs`` on completions (per choice) and chat (top level), checked against the
offline engine's SamplingParams(prompt_logprobs=k) on the same tiny random Llama."""
import json

import pytest
import requests

from tests.entrypoints.openai.conftest import LiveServer, start_tiny_engine
from tokenmill import LLM, SamplingParams
from tokenmill.entrypoints.openai.server import build_app

pytestmark = pytest.mark.e2e
PROMPT = "The quick brown fox jumps"
BASE = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir):
    engine = start_tiny_engine(tiny_chat_model_dir)
    with LiveServer(build_app(engine, "tiny")) as live:
        yield live
    engine.stop()


@pytest.fixture(scope="module")
def offline(tiny_chat_model_dir):
    return LLM(model=tiny_chat_model_dir, num_kv_blocks=64, block_size=16, num_threads=1)


def complete(server, **changes) -> dict:
    r = requests.post(server.url + "/v1/completions", json={**BASE, **changes}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def offline_prompt_logprobs(offline, k: int):
    out = offline.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=k),
                           use_tqdm=False)[0]
    return out.prompt_token_ids, out.prompt_logprobs


def test_echo_returns_prompt_plus_completion(server):
    plain = complete(server)["choices"][0]["text"]
    echoed = complete(server, echo=True)
    assert echoed["choices"][0]["text"] == PROMPT + plain
    assert echoed["usage"]["completion_tokens"] == 5


def test_echo_logprobs_score_the_prompt_like_prompt_logprobs(server, offline):
    plain = complete(server, logprobs=2)["choices"][0]["logprobs"]
    lps = complete(server, echo=True, logprobs=2)["choices"][0]["logprobs"]
    ids, want = offline_prompt_logprobs(offline, 2)
    n = len(ids)
    assert len(lps["tokens"]) == n + 5
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    for pos in range(1, n):
        assert abs(lps["token_logprobs"][pos] - want[pos][ids[pos]].logprob) < 1e-5
        assert len(lps["top_logprobs"][pos]) == 2
    assert lps["tokens"][n:] == plain["tokens"]
    assert all(abs(a - b) < 1e-5 for a, b in zip(lps["token_logprobs"][n:], plain["token_logprobs"]))
    assert "".join(lps["tokens"][:n]) == PROMPT
    assert lps["text_offset"][n] == len(PROMPT)


def test_echo_with_max_tokens_zero_scores_the_prompt_only(server, offline):
    body = complete(server, echo=True, max_tokens=0, logprobs=0)
    choice = body["choices"][0]
    assert choice["text"] == PROMPT
    ids, want = offline_prompt_logprobs(offline, 0)
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert abs(choice["logprobs"]["token_logprobs"][-1] - want[-1][ids[-1]].logprob) < 1e-5
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] == len(ids)


def test_max_tokens_zero_without_echo_is_a_400(server):
    r = requests.post(server.url + "/v1/completions", json={**BASE, "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def stream_choices(server, **changes) -> dict:
    """choice index -> its chunks, in order."""
    r = requests.post(server.url + "/v1/completions", stream=True, timeout=60,
                      json={**BASE, **changes, "stream": True})
    chunks = {}
    for line in r.iter_lines():
        if not line or line == b"data: [DONE]":
            continue
        for c in json.loads(line[len(b"data: "):])["choices"]:
            chunks.setdefault(c["index"], []).append(c)
    return chunks


def stream_texts(server, **changes) -> dict:
    return {i: [c["text"] for c in chunks] for i, chunks in stream_choices(server, **changes).items()}


def test_streamed_echo_leads_each_choice_with_the_prompt(server):
    changes = dict(n=2, temperature=1.0, seed=3, echo=True)
    whole = complete(server, **changes)["choices"]
    texts = stream_texts(server, **changes)
    for c in whole:
        chunks = texts[c["index"]]
        assert chunks[0].startswith(PROMPT) and "".join(chunks) == c["text"]
    assert stream_texts(server, echo=True, max_tokens=0)[0] == [PROMPT]
    whole = complete(server, echo=True, logprobs=1)["choices"][0]["logprobs"]
    chunks = stream_choices(server, echo=True, logprobs=1)[0]
    streamed = {key: sum((c["logprobs"][key] for c in chunks), []) for key in whole}
    assert streamed["tokens"] == whole["tokens"] and streamed["text_offset"] == whole["text_offset"]
    assert streamed["token_logprobs"][0] is None and streamed["top_logprobs"][0] is None


def test_prompt_logprobs_on_completions_per_choice(server, offline):
    body = complete(server, prompt_logprobs=1, n=2, temperature=1.0, seed=1)
    ids, want = offline_prompt_logprobs(offline, 1)
    for choice in body["choices"]:
        plp = choice["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        for pos in range(1, len(ids)):
            entry = plp[pos][str(ids[pos])]
            assert abs(entry["logprob"] - want[pos][ids[pos]].logprob) < 1e-5
            assert entry["rank"] == want[pos][ids[pos]].rank and entry["decoded_token"]
            assert 1 <= len(plp[pos]) <= 2
    assert "prompt_logprobs" not in complete(server)["choices"][0]


def test_prompt_logprobs_on_chat_at_the_top_level(server):
    r = requests.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi there"}],
        "max_tokens": 2, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    plp = r.json()["prompt_logprobs"]
    assert plp[0] is None and len(plp) == r.json()["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in plp[1:])


@pytest.mark.parametrize("route,changes", [
    ("completions", {"prompt_logprobs": 21}), ("completions", {"prompt_logprobs": -1}),
    ("completions", {"prompt_logprobs": 1, "stream": True}),
    ("chat", {"prompt_logprobs": 1, "stream": True}),
])
def test_bad_prompt_logprobs_is_a_400(server, route, changes):
    if route == "chat":
        url, body = "/v1/chat/completions", {"model": "tiny", "max_tokens": 2,
                                             "messages": [{"role": "user", "content": "Hi"}]}
    else:
        url, body = "/v1/completions", dict(BASE)
    r = requests.post(server.url + url, json={**body, **changes}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
