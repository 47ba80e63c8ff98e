"""/metrics of a server running with speculation (layer_skip, tiny random model, real HTTP):
the tokenmill:spec_decode_* counters advance with the engine's own counters, and each
finished request lands in the per-request histograms."""
import re

import pytest
import requests

from tests.entrypoints.openai.conftest import LiveServer
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.entrypoints.openai.server import build_app

pytestmark = pytest.mark.e2e


def _value(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m, f"{name} not exported"
    return float(m.group(1))


def test_spec_metrics_exposed(tiny_spec_chat_dir):
    from tokenmill.entrypoints.llm import LLM
    spec = {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 3, "adaptive": False}
    engine = AsyncEngine(lambda: LLM(model=tiny_spec_chat_dir, num_kv_blocks=64, block_size=16,
                                     max_num_seqs=4, num_threads=1,
                                     speculative_config=spec).engine)
    engine.start()
    try:
        assert engine.ready.wait(60) and engine.load_error is None, engine.load_error
        with LiveServer(build_app(engine, "tiny")) as server:
            body = {"model": "tiny", "prompt": "one two three one two three one two three",
                    "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            for _ in range(2):
                r = requests.post(server.url + "/v1/completions", json=body, timeout=60)
                assert r.status_code == 200, r.text
            # Read in the engine thread first: by then the last step's snapshot was published.
            stats = engine.call(lambda e: e.get_stats()).result(10)["spec_decode"]
            text = requests.get(server.url + "/metrics", timeout=10).text
    finally:
        engine.stop()
    p = "tokenmill:spec_decode_"
    assert stats["num_drafts"] > 0
    assert _value(text, p + "num_drafts_total") == stats["num_drafts"]
    assert _value(text, p + "num_draft_tokens_total") == stats["num_draft_tokens"]
    assert _value(text, p + "num_accepted_tokens_total") == stats["num_accepted_tokens"]
    per_pos = sum(float(v) for v in re.findall(
        rf"^{re.escape(p)}num_accepted_tokens_per_pos_total{{[^}}]*}} (\S+)$", text, re.M))
    assert per_pos == stats["num_accepted_tokens"]
    assert _value(text, p + "draft_time_seconds_total") > 0
    assert _value(text, p + "verify_time_seconds_total") > 0
    assert _value(text, p + "mean_acceptance_length") >= 1.0
    assert _value(text, p + "estimated_speedup") > 0
    assert _value(text, p + "request_acceptance_length_count") == 2
    assert _value(text, p + "request_estimated_speedup_count") == 2
    assert _value(text, p + "request_verify_time_seconds_count") == 2
