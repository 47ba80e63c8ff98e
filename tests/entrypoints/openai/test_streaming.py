"""The streaming contract over real HTTP, with the official `openai` client and raw SSE:
deltas joined equal the non-streamed text (temperature 0), exactly one finish_reason per
choice then [DONE], usage counts equal the streamed tokens, concurrency changes nothing."""
import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from tests.entrypoints.openai.conftest import MODEL_NAME, wait_idle

pytestmark = pytest.mark.e2e
CHAT = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def sse_events(url: str, body: dict) -> list:
    """Raw `data:` payloads of a streamed response, in order ("[DONE]" kept as a string)."""
    with requests.post(url, json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines(decode_unicode=True) if ln]
    assert all(ln.startswith("data: ") for ln in lines), lines
    return [ln[6:] if ln[6:] == "[DONE]" else json.loads(ln[6:]) for ln in lines]


def test_chat_stream_equals_non_stream(client):
    full = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, temperature=0,
                                          max_tokens=12)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, temperature=0,
                                            max_tokens=12, stream=True)
    chunks = list(stream)
    joined = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert joined == full.choices[0].message.content
    assert joined
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [full.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"


def test_completion_stream_equals_non_stream(client):
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, temperature=0, max_tokens=12)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, temperature=0,
                                            max_tokens=12, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert full.usage.prompt_tokens > 0 and full.usage.completion_tokens == 12
    assert full.choices[0].finish_reason == "length"


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_one_finish_reason_per_choice_then_done_and_usage(server, route):
    body = {"model": MODEL_NAME, "n": 2, "temperature": 0.8, "seed": 7, "max_tokens": 12,
            "stream": True, "stream_options": {"include_usage": True}}
    if route == "chat":
        url = server.url + "/v1/chat/completions"
        body.update(messages=CHAT, logprobs=True, top_logprobs=1)
    else:
        url = server.url + "/v1/completions"
        body.update(prompt=PROMPT, logprobs=1)
    events = sse_events(url, body)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] > 0
    finish, streamed_tokens = {}, 0
    for ev in events[:-2]:
        assert "error" not in ev
        for choice in ev["choices"]:
            assert choice["index"] not in finish, "content after finish_reason"
            if choice["finish_reason"] is not None:
                finish[choice["index"]] = choice["finish_reason"]
            lps = choice.get("logprobs")
            if lps:
                streamed_tokens += len(lps["content"] if route == "chat" else lps["tokens"])
    assert sorted(finish) == [0, 1]
    assert streamed_tokens == usage_chunk["usage"]["completion_tokens"]
    u = usage_chunk["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


def test_seeded_sampling_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, temperature=1.0, seed=1234, max_tokens=8)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text


def test_eight_concurrent_streams_match_sequential(client, async_engine):
    prompts = [f"My favourite number is {i} because" for i in range(8)]

    def run(prompt):
        stream = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0,
                                           max_tokens=6, stream=True)
        return "".join(c.choices[0].text for c in stream)

    sequential = [run(p) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(run, prompts))
    assert concurrent == sequential
    state = wait_idle(async_engine)
    assert state["unfinished"] == 0 and state["free_blocks"] == state["total_blocks"]


def test_stop_string_and_cached_tokens(client):
    long_prompt = "Once upon a time, " * 12 + "there was"
    first = client.completions.create(model=MODEL_NAME, prompt=long_prompt, temperature=0,
                                      max_tokens=8)
    again = client.completions.create(model=MODEL_NAME, prompt=long_prompt, temperature=0,
                                      max_tokens=8)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    word = first.choices[0].text.split()[0]
    stopped = client.completions.create(model=MODEL_NAME, prompt=long_prompt, temperature=0,
                                        max_tokens=8, stop=[word])
    assert word not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"


def test_models_tokenize_detokenize_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    ids = requests.post(server.url + "/tokenize", json={"prompt": PROMPT}, timeout=30).json()
    assert ids["count"] == len(ids["tokens"]) > 0
    text = requests.post(server.url + "/detokenize", json={"tokens": ids["tokens"]}, timeout=30)
    assert text.json()["prompt"].strip() == PROMPT
    chat_ids = requests.post(server.url + "/tokenize", json={"messages": CHAT}, timeout=30).json()
    assert chat_ids["count"] > ids["count"]
    assert requests.get(server.url + "/version", timeout=10).json()["version"]
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


def test_metrics_exposed(server):
    text = requests.get(server.url + "/metrics", timeout=10).text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_preemptions", "prompt_tokens_total", "generation_tokens_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "spec_decode_num_draft_tokens_total"):
        assert f"tokenmill:{name}" in text, name
