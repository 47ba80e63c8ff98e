"""The web UI's server side: pages with a strict CSP and no CORS, static files that cannot
leave their folder, the key gate (pages open, data behind the key), --disable-web-ui, and the
dashboard's engine stream moving while a request runs (browser tests: test_browser.py)."""
import json
import threading
import time

import pytest
import requests

from tests.entrypoints.openai.conftest import (LiveServer, smollm2_path,  # noqa: F401 (fixtures)
                                               start_engine, start_tiny_engine, tiny_chat_model_dir)
from tokenmill.entrypoints.openai.server import build_app
from tokenmill.entrypoints.web import SECURITY_HEADERS

pytestmark = pytest.mark.e2e
KEY = "sekret-key-42"


@pytest.fixture(scope="module")
def tiny_engine(tiny_chat_model_dir):  # noqa: F811
    engine = start_tiny_engine(tiny_chat_model_dir)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def open_server(tiny_engine):
    with LiveServer(build_app(tiny_engine, "tiny")) as live:
        yield live


@pytest.fixture(scope="module")
def keyed_server(tiny_engine):
    with LiveServer(build_app(tiny_engine, "tiny", api_key=KEY)) as live:
        yield live


def _events(url: str, headers=None, count: int = 3, timeout: float = 20.0) -> list[dict]:
    """The first ``count`` events of the engine stream."""
    out = []
    with requests.get(url + "/v1/engine/stream", headers=headers, stream=True, timeout=timeout) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
                if len(out) == count:
                    break
    return out


@pytest.mark.parametrize("path,kind", [("/", "text/html"), ("/dashboard", "text/html"),
                                       ("/static/common.js", "text/javascript")])
def test_pages_carry_a_strict_csp(open_server, path, kind):
    r = requests.get(open_server.url + path, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
    for name, value in SECURITY_HEADERS.items():
        assert r.headers[name] == value
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp


def test_pages_have_no_inline_code_and_no_outside_urls(open_server):
    for path in ("/", "/dashboard"):
        html = requests.get(open_server.url + path, timeout=10).text
        assert "<script>" not in html and "style=" not in html and "<style" not in html
        assert "http://" not in html and "https://" not in html   # no CDN: works offline


@pytest.mark.parametrize("name", ["../__init__.py", "..%2F__init__.py", ".hidden", "nothing.js",
                                  "__init__.py"])
def test_static_files_stay_in_their_folder(open_server, name):
    assert requests.get(open_server.url + "/static/" + name, timeout=10).status_code == 404


def test_no_cors_by_default(open_server):
    origin = {"Origin": "https://evil.example"}
    preflight = requests.options(open_server.url + "/v1/completions", timeout=10,
                                 headers={**origin, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers
    r = requests.get(open_server.url + "/v1/models", headers=origin, timeout=10)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_pages_open_but_data_behind_the_key(keyed_server):
    url = keyed_server.url
    for path in ("/", "/dashboard", "/static/playground.js", "/web/config"):
        assert requests.get(url + path, timeout=10).status_code == 200, path
    assert requests.get(url + "/web/config", timeout=10).json()["auth_required"] is True
    assert KEY not in requests.get(url + "/", timeout=10).text
    for path in ("/v1/engine/stream", "/v1/engine/requests/x", "/v1/models"):
        r = requests.get(url + path, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert _events(url, {"Authorization": f"Bearer {KEY}"}, count=1)[0]["model"] == "tiny"


def test_disable_web_ui_turns_both_pages_off(tiny_engine):
    with LiveServer(build_app(tiny_engine, "tiny", web_ui=False)) as live:
        for path in ("/", "/dashboard", "/static/common.js", "/web/config"):
            assert requests.get(live.url + path, timeout=10).status_code == 404, path
        assert requests.get(live.url + "/v1/models", timeout=10).status_code == 200
    with LiveServer(build_app(tiny_engine, "tiny", api_key=KEY, web_ui=False)) as live:
        assert requests.get(live.url + "/", timeout=10).status_code == 401   # no longer open


def test_stream_reports_the_engine_and_moves_under_load(open_server):
    idle = _events(open_server.url, count=2)
    kv = idle[-1]["kv"]
    assert len(kv["map"]) == kv["num_blocks"] == kv["num_used"] + kv["num_cached"] + kv["num_free"]
    assert idle[-1]["num_running"] == 0 and idle[-1]["spec"] is None
    start = idle[-1]["generation_tokens_total"]
    stop = threading.Event()

    def load():
        while not stop.is_set():
            requests.post(open_server.url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": "hello there", "max_tokens": 40,
                                "ignore_eos": True})
    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    try:
        busy = _events(open_server.url, count=6)
    finally:
        stop.set()
        worker.join(60)
    assert busy[-1]["generation_tokens_total"] > start
    assert any(e["generation_tokens_per_s"] > 0 for e in busy[1:])
    assert any(e["num_running"] > 0 or "u" in e["kv"]["map"] for e in busy)
    later = _events(open_server.url, count=1)[0]
    assert later["num_requests_finished"] >= 1 and later["ttft_ms"]["p50"] > 0
    assert later["itl_ms"]["p99"] >= later["itl_ms"]["p50"]


def test_stream_events_arrive_at_least_once_a_second(open_server):
    t0 = time.monotonic()
    events = _events(open_server.url, count=4)
    assert len(events) == 4 and time.monotonic() - t0 < 4.0


def test_request_spec_figures(tiny_chat_model_dir):  # noqa: F811
    from tokenmill.entrypoints.llm import LLM
    engine = start_engine(lambda: LLM(model=tiny_chat_model_dir, num_kv_blocks=64, num_threads=1,
                                      speculative_config={"method": "ngram",
                                                          "num_speculative_tokens": 3}))
    try:
        with LiveServer(build_app(engine, "tiny")) as live:
            r = requests.post(live.url + "/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": "a b a b a b a b", "max_tokens": 16,
                                    "ignore_eos": True})
            request_id = r.json()["id"]
            got = requests.get(f"{live.url}/v1/engine/requests/{request_id}", timeout=10)
            assert got.status_code == 200
            spec = got.json()["spec_decode"]
            assert spec["request_id"] == request_id and spec["num_output_tokens"] > 0
            assert requests.get(live.url + "/v1/engine/requests/nope", timeout=10).status_code == 404
            event = _events(live.url, count=1)[0]
            assert event["spec"]["method"] == "ngram" and event["spec"]["num_speculative_tokens"] == 3
            assert len(event["spec"]["accepted_per_position"]) == 3
    finally:
        engine.stop()
