"""The OpenAI server on a tensor-parallel engine: the same text as one process; a rank that
dies mid-request ends the in-flight request with an error and /health with 503 (no hang);
stopping leaves no rank process behind."""
import multiprocessing
import threading

import pytest
import requests

from tests.entrypoints.openai.conftest import (LiveServer, smollm2_path,  # noqa: F401 (fixtures)
                                               start_engine, tiny_chat_model_dir)
from tokenmill.entrypoints.llm import LLM
from tokenmill.entrypoints.openai.server import build_app


def _rank_processes():
    return [c for c in multiprocessing.active_children() if c.name.startswith("tokenmill-tp")]


def _complete(url, prompt, max_tokens=12, stream=False, timeout=60):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": stream}
    return requests.post(f"{url}/v1/completions", json=body, timeout=timeout, stream=stream)


def _serve(model_dir, tp):
    engine = start_engine(lambda: LLM(model=model_dir, num_kv_blocks=64, block_size=16,
                                      max_num_seqs=8, tensor_parallel_size=tp))
    return engine, LiveServer(build_app(engine, "tiny", web_ui=False))


def test_tp2_server_text_matches_and_a_dead_rank_fails_cleanly(tiny_chat_model_dir):
    single, server = _serve(tiny_chat_model_dir, 1)
    with server:
        expected = _complete(server.url, "The capital of France is").json()["choices"][0]["text"]
    single.stop()

    engine, server = _serve(tiny_chat_model_dir, 2)
    try:
        with server:
            got = _complete(server.url, "The capital of France is")
            assert got.status_code == 200 and got.json()["choices"][0]["text"] == expected
            assert requests.get(f"{server.url}/health", timeout=10).status_code == 200
            ranks = _rank_processes()
            assert len(ranks) == 2

            # A long streamed request is in flight when rank 1 dies.
            stream = _complete(server.url, "Once upon a time", max_tokens=48, stream=True)
            assert stream.status_code == 200
            lines = stream.iter_lines()
            next(lines)   # the first event arrived: the request is running
            killer = threading.Timer(0.0, ranks[1].kill)
            killer.start()
            rest = b"\n".join(line for line in lines if line)
            assert b"error" in rest   # the stream ends with an error event, not a hang
            health = requests.get(f"{server.url}/health", timeout=10)
            assert health.status_code == 503 and "engine failed" in health.json()["reason"]
            after = _complete(server.url, "Hello")
            assert after.status_code in (500, 503) and "error" in after.json()
    finally:
        engine.stop()
    assert _rank_processes() == []
