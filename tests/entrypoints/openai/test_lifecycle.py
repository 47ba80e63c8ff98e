"""Faults and lifecycle over real HTTP: a client disconnect aborts its request (blocks return),
overload is a 503 with Retry-After, an engine whose forward pass keeps failing fails the
requests with an SSE error event and turns /health to 503, and SIGTERM drains in-flight
requests, answers new ones 503 and exits 0 (under load and past the drain deadline:
test_sigterm_load.py)."""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import requests

from tests.entrypoints.openai.conftest import (MODEL_NAME, LiveServer, engine_state,
                                               start_engine, wait_idle)
from tokenmill.entrypoints.openai.server import build_app

pytestmark = pytest.mark.e2e
LONG = {"model": MODEL_NAME, "prompt": "Count to one thousand:", "max_tokens": 500,
        "ignore_eos": True, "temperature": 0}


def _running_metric(server) -> float:
    for line in requests.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("tokenmill:num_requests_running{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no running gauge")


def test_disconnect_mid_stream_aborts(server, async_engine):
    r = requests.post(server.url + "/v1/completions", json=dict(LONG, stream=True), stream=True,
                      timeout=60)
    data = (ln for ln in r.iter_lines() if ln.startswith(b"data: "))
    for _ in range(3):          # some tokens have streamed: the request is decoding
        next(data)
    assert engine_state(async_engine)["unfinished"] == 1
    r.close()
    state = wait_idle(async_engine, timeout=10)
    assert state["unfinished"] == 0
    assert state["free_blocks"] == state["total_blocks"]
    assert _running_metric(server) == 0


def test_disconnect_while_waiting_for_non_streamed_answer_aborts(server, async_engine):
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(server.url + "/v1/completions", json=LONG, timeout=(5, 1.5))
    state = wait_idle(async_engine, timeout=10)
    assert state["unfinished"] == 0 and state["free_blocks"] == state["total_blocks"]


def test_overload_is_503_with_retry_after(server, async_engine):
    saved = async_engine.max_pending
    async_engine.max_pending = 1
    try:
        with requests.post(server.url + "/v1/completions", json=dict(LONG, stream=True),
                           stream=True, timeout=60) as held:
            lines = held.iter_lines()   # keep a reference: a collected iterator closes the socket
            next(lines)
            r = requests.post(server.url + "/v1/completions", timeout=30,
                              json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "server_overloaded"
    finally:
        async_engine.max_pending = saved
    assert wait_idle(async_engine)["unfinished"] == 0


def test_engine_fault_fails_requests_and_health(tiny_chat_model_dir):
    # One failed step fails only its request now (test_request_faults.py); an engine whose
    # steps keep failing stops after max_failed_steps_in_a_row, here the first.
    from tokenmill.entrypoints.llm import LLM
    engine = start_engine(lambda: LLM(model=tiny_chat_model_dir, num_kv_blocks=64, block_size=16,
                                      max_num_seqs=8, num_threads=1, max_failed_steps_in_a_row=1))

    def boom(*args, **kwargs):
        raise RuntimeError("injected forward failure")

    engine.call(lambda e: setattr(e.runner, "execute", boom)).result(10)
    try:
        with LiveServer(build_app(engine, "tiny")) as live:
            body = {"prompt": [1, 2, 3], "max_tokens": 5, "stream": True}
            with requests.post(live.url + "/v1/completions", json=body, stream=True,
                               timeout=30) as r:
                events = [ln for ln in r.iter_lines(decode_unicode=True) if ln]
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2][6:])["error"]
            assert "injected" not in error["message"] and error["type"] == "internal_error"
            health = requests.get(live.url + "/health", timeout=10)
            assert health.status_code == 503 and "failed" in health.json()["reason"]
            r = requests.post(live.url + "/v1/completions", timeout=10,
                              json={"prompt": [1, 2], "max_tokens": 2})
            assert r.status_code == 503
            r = requests.post(live.url + "/v1/completions", timeout=10,
                              json={"prompt": [1, 2], "max_tokens": 2, "stream": True})
            assert r.status_code == 503
    finally:
        engine.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.2)
    raise AssertionError("server did not become healthy")


def test_sigterm_drains_then_exits_zero(long_model_dir):
    # 2048 positions and 1500 tokens a stream: the drain lasts seconds, so the late request
    # surely meets a draining server (with 64 positions it could meet a closed listener).
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--model",
           long_model_dir, "--port", str(port), "--num-kv-blocks", "320",
           "--num-threads", "1", "--served-model-name", "tiny", "--log-level", "warning"]
    log = tempfile.TemporaryFile("w+")     # a pipe nobody reads could fill and block the server
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        _wait_healthy(url, proc)
        results = {}
        streaming = [threading.Event() for _ in range(3)]

        def stream(i):
            body = {"prompt": [1, 2, 3 + i], "max_tokens": 1500, "ignore_eos": True,
                    "stream": True}
            lines = results[i] = []
            with requests.post(url + "/v1/completions", json=body, stream=True, timeout=60) as r:
                for line in r.iter_lines(decode_unicode=True):
                    if line:
                        lines.append(line)
                        streaming[i].set()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        # SIGTERM only once every stream has its first token: a request the server had not
        # yet accepted would rightly get a 503, which is not what this test is about.
        for started in streaming:
            assert started.wait(60)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while requests.get(url + "/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "/health never said draining"
            time.sleep(0.05)
        late = requests.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 2},
                             timeout=10)
        assert late.status_code == 503 and "retry-after" in late.headers
        assert all(t.is_alive() for t in threads), "the streams ended before the late request"
        for t in threads:
            t.join(60)
        assert proc.wait(30) == 0
        for lines in results.values():
            assert lines[-1] == "data: [DONE]"
            finishes = [json.loads(ln[6:])["choices"][0]["finish_reason"] for ln in lines[:-1]]
            assert finishes[-1] == "length"
        assert len(results) == 3
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
