import requests, time
from tests.entrypoints.openai.conftest import MODEL_NAME, wait_idle
from tests.entrypoints.openai.test_lifecycle import LONG

def test_dbg(server, async_engine):
    async_engine.max_pending = 1
    with requests.post(server.url + "/v1/completions", json=dict(LONG, stream=True), stream=True, timeout=60) as held:
        print(next(held.iter_lines()))
        print("pending1", async_engine.num_pending, async_engine.max_pending)
        r = requests.post(server.url + "/v1/completions", timeout=30, json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2})
        print(r.status_code, r.text[:200])
        print("pending2", async_engine.num_pending, async_engine.max_pending)
