"""Speculative decoding stats on a tiny random Llama: the vLLM-style counters agree with the
tokens each request emitted, per-request stats add up to the aggregate, the plain step cost
c(B) is measured (also with a fixed k) so the estimated speedup exists, and finished requests
move to a bounded recent list. Plus the pure-Python pieces alone."""
import pytest

from tests.spec.test_spec_engine import PROMPTS, greedy, spec_llm
from tokenmill.spec.metrics import RECENT_REQUESTS, PlainStepCost, SpecDecodingStats


@pytest.fixture(scope="module")
def draft_dir():
    return None          # draft_model is not used here


@pytest.mark.parametrize("method,adaptive", [("ngram", False), ("layer_skip", True)])
def test_counters_match_emitted_tokens(tiny_llama_dir, draft_dir, method, adaptive):
    llm = spec_llm(tiny_llama_dir, draft_dir, method, adaptive=adaptive)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(20), use_tqdm=False)
    stats = llm.get_stats()
    spec = stats["spec_decode"]
    reqs = {r["request_id"]: r for r in spec["requests"]}
    # Every request is listed, finished, and its emitted tokens are exactly its output.
    assert set(reqs) == {o.request_id for o in outs}
    for o in outs:
        r = reqs[o.request_id]
        assert r["finished"] and r["num_output_tokens"] == len(o.outputs[0].token_ids) == 20
        # drafted steps emit accepted + one recovered / bonus token each; the rest were plain
        assert r["num_emitted_tokens"] == r["num_drafts"] + r["num_accepted_tokens"]
        assert r["num_emitted_tokens"] <= r["num_output_tokens"] - 1   # the first came from prefill
        assert r["num_accepted_tokens"] <= r["num_draft_tokens"] <= 3 * r["num_drafts"]
        if r["num_drafts"]:
            assert r["verify_time_s"] > 0 and r["draft_time_s"] > 0
            assert r["mean_acceptance_length"] == 1 + r["num_accepted_tokens"] / r["num_drafts"]
        assert r["draft_time_s"] <= spec["draft_time_s"] + 1e-9
    assert sum(r["num_output_tokens"] for r in reqs.values()) == stats["num_generated_tokens"]
    # The aggregate is the sum of the requests; per-position counts are nested.
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert spec[key] == sum(r[key] for r in reqs.values()) == stats["spec_" + key]
    per_pos = spec["num_accepted_tokens_per_pos"]
    assert sum(per_pos) == spec["num_accepted_tokens"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])) and per_pos[0] <= spec["num_drafts"]
    assert spec["num_drafts"] > 0 and spec["mean_acceptance_length"] >= 1.0
    assert spec["draft_time_s"] > 0 and spec["verify_time_s"] > 0
    # c(B) was measured (a fixed k takes a plain step now and then), so the estimate exists.
    assert spec["plain_step_ms"] and spec["estimated_speedup"] > 0
    assert spec["k_chosen"].get(0, 0) > 0
    assert any(r["estimated_speedup"] is not None for r in reqs.values())
    assert not llm.engine.runner.spec.stats.live         # nothing left running


def test_recent_list_is_bounded_and_aborts_finish(tiny_llama_dir, draft_dir):
    llm = spec_llm(tiny_llama_dir, draft_dir, "ngram")
    engine = llm.engine
    rid = engine.add_request(None, {"prompt_token_ids": PROMPTS[1]}, greedy(40))
    for _ in range(4):
        engine.step()
    running = {r["request_id"]: r for r in llm.get_stats()["spec_decode"]["requests"]}
    assert running[rid]["finished"] is False and running[rid]["num_output_tokens"] > 0
    engine.abort_request(rid)
    done = {r["request_id"]: r for r in llm.get_stats()["spec_decode"]["requests"]}
    assert done[rid]["finished"] is True
    stats = engine.runner.spec.stats
    for i in range(RECENT_REQUESTS + 5):
        stats.request(f"x{i}")
        stats.finish(f"x{i}")
    assert len(stats.requests()) == RECENT_REQUESTS
    assert [r.request_id for r in stats.finished_since(stats.num_finished - 2)] == \
        [f"x{RECENT_REQUESTS + 3}", f"x{RECENT_REQUESTS + 4}"]


def test_plain_step_cost_asks_for_samples_then_refreshes():
    cost = PlainStepCost(ema=0.5, min_samples=2, refresh_every=3)
    assert cost.get(5) is None and cost.wants_sample(5)
    cost.record(5, 1.0)
    cost.record(7, 3.0)                       # 5 and 7 share the bucket of 8
    assert cost.get(6) == 2.0 and cost.get(1) is None
    assert [cost.wants_sample(8) for _ in range(4)] == [False, False, False, True]
    assert PlainStepCost(refresh_every=0).wants_sample(1) is False


def test_request_stats_from_verified_steps():
    s = SpecDecodingStats(3)
    s.on_verified(3, 4, "a", 0.5)       # all 3 accepted + bonus
    s.on_verified(3, 1, "a", 0.5)       # first rejected: the recovered token only
    s.on_verified(2, 2, "b", 0.25)
    s.on_verified(0, 1, "b", 0.25)      # no drafts: not counted
    a, b = s.live["a"], s.live["b"]
    assert (a.num_drafts, a.num_accepted_tokens, a.num_emitted_tokens, a.verify_time) == (2, 3, 5, 1.0)
    assert a.mean_acceptance_length == 2.5 and b.mean_acceptance_length == 2.0
    assert s.accepted_per_position == [2, 1, 1] and s.num_draft_tokens == 8
    assert s.counters()["mean_acceptance_length"] == pytest.approx(1 + 4 / 3)
    assert a.estimated_speedup is None and s.estimated_speedup == 0.0
