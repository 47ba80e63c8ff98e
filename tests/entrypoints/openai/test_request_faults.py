"""Over HTTP, a request whose step raises gets an OpenAI-shaped error (500 whole, an error
event when streamed) while the requests batched with it finish with the text they would
have had alone; the server stays healthy and counts the failed steps."""
import concurrent.futures
import json

import requests

from tests.entrypoints.openai.conftest import LiveServer, start_engine, wait_idle
from tokenmill.config import FaultRule
from tokenmill.entrypoints.llm import LLM
from tokenmill.entrypoints.openai.server import build_app

TRIGGER = [1000, 1001, 1002]   # token ids a client puts in its prompt


def _complete(url, prompt, stream=False, max_tokens=16):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": stream, "ignore_eos": True}
    r = requests.post(f"{url}/v1/completions", json=body, timeout=60, stream=stream)
    if not stream:
        return r.status_code, r.json()
    events = [ln for ln in r.iter_lines(decode_unicode=True) if ln]
    return r.status_code, events


def _streamed_text(events):
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))


def test_a_faulty_request_fails_alone_over_http(tiny_chat_model_dir):
    rules = [FaultRule("forward_error", tuple(TRIGGER), at_output_token=3)]
    engine = start_engine(lambda: LLM(model=tiny_chat_model_dir, num_kv_blocks=64, block_size=16,
                                      max_num_seqs=8, num_threads=1, fault_injection=rules))
    clean = ["Once upon a time", "The capital of France is", "def fib(n):"]
    faulty = [5, 6, 7] + TRIGGER + [8, 9]
    try:
        with LiveServer(build_app(engine, "tiny", web_ui=False)) as live:
            alone = [_complete(live.url, p)[1]["choices"][0]["text"] for p in clean]
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                streams = [pool.submit(_complete, live.url, p, True) for p in clean]
                bad_whole = pool.submit(_complete, live.url, faulty)
                bad_stream = pool.submit(_complete, live.url, faulty, True)
                status, body = bad_whole.result()
                assert status == 500 and body["error"]["code"] == "engine_error"
                assert "InjectedFault" in body["error"]["message"]
                status, events = bad_stream.result()
                assert status == 200 and events[-1] == "data: [DONE]"
                assert "error" in json.loads(events[-2][6:])
                assert [_streamed_text(f.result()[1]) for f in streams] == alone
            assert requests.get(f"{live.url}/health", timeout=10).status_code == 200
            metrics = requests.get(f"{live.url}/metrics", timeout=10).text
            failed = [ln for ln in metrics.splitlines() if ln.startswith("tokenmill:failed_steps_total")]
            assert failed and float(failed[0].split()[-1]) >= 2
            assert wait_idle(engine)["unfinished"] == 0
    finally:
        engine.stop()
