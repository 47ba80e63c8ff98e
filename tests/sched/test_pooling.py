"""Pooling (prompt-only) requests in the scheduler, with a pure-Python stand-in runner: they
are chunked and batched like prefills, never sample, finish once the prompt is computed, and
mean pooling never takes prefix-cache hits (it must see every prompt row)."""
import pytest

from tests.sched.test_scheduler import HistoryModel, make_sched, req
from tokenmill.outputs import ModelRunnerOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams


class PoolingModel:
    """Generation requests as in HistoryModel; a pooling request's "vector" is the list of
    prompt positions the runner computed for it (prefix-cache hits are not computed), so a
    skipped or repeated row shows."""

    def __init__(self):
        self.history = HistoryModel()
        self.rows: dict[str, list[int]] = {}

    def execute(self, sched, so):
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.rows.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.rows[new.req_id] = []
        out = self.history.execute(sched, so)
        for b, rid in enumerate(out.req_ids):
            request = sched.requests[rid]
            if request.pooling_params is None:
                continue
            out.sampled_token_ids[b] = []   # the real runner never samples these
            start, end = request.num_computed_tokens, request.num_computed_tokens + so.num_scheduled_tokens[rid]
            self.rows[rid].extend(range(start, end))
            if end == request.num_prompt_tokens:
                out.pooled[rid] = [float(p) for p in self.rows[rid]]
        return out


def pooling_req(rid, n_prompt, pooling_type="mean"):
    prompt = [(7 * int(rid.split("-")[-1]) + 3 * i) % 999 + 1 for i in range(n_prompt)]
    return Request(rid, prompt, SamplingParams(), 0,
                   pooling_params=PoolingParams(pooling_type=pooling_type))


def run(sched, model):
    tokens, pooled, finish = {}, {}, {}
    while sched.has_unfinished_requests():
        so = sched.schedule()
        for new in so.scheduled_new_reqs:
            assert new.pooling_params == sched.requests[new.req_id].pooling_params
        for out in sched.update_from_output(so, model.execute(sched, so)):
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.pooled is not None:
                pooled[out.req_id] = out.pooled
            if out.finished:
                finish[out.req_id] = out.finish_reason
    return tokens, pooled, finish


def test_pooling_requests_are_chunked_batched_and_finish_with_their_prompt():
    gen = [("r-1", 9, 5), ("r-2", 3, 7)]
    ref = {}
    for spec in gen:
        s = make_sched()
        s.add_request(req(*spec))
        ref.update(run(s, PoolingModel())[0])
    s = make_sched(budget=6)
    s.add_request(req(*gen[0]))
    s.add_request(pooling_req("p-3", 17))
    s.add_request(pooling_req("p-4", 1, "last"))
    s.add_request(req(*gen[1]))
    tokens, pooled, finish = run(s, PoolingModel())
    assert {r: tokens[r] for r in ref} == ref
    assert pooled == {"p-3": [float(p) for p in range(17)], "p-4": [0.0]}
    assert not tokens.get("p-3") and not tokens.get("p-4")
    assert finish["p-3"] == finish["p-4"] == "stop"
    assert s.kv.num_free_blocks == s.kv.num_total_blocks


def test_preempted_pooling_request_recomputes_every_row():
    s = make_sched(num_blocks=6, block_size=4, budget=4)
    s.add_request(req("r-1", 12, max_tokens=8))
    s.add_request(pooling_req("p-2", 10))
    tokens, pooled, _ = run(s, PoolingModel())
    assert s.num_preemptions > 0
    assert pooled["p-2"] == [float(p) for p in range(10)]
    assert len(tokens["r-1"]) == 8


@pytest.mark.parametrize("pooling_type,hits", [("mean", 0), ("last", 8)])
def test_only_last_pooling_takes_prefix_cache_hits(pooling_type, hits):
    s = make_sched(block_size=4)
    warm = req("r-5", 12, max_tokens=1)
    s.add_request(warm)
    run(s, PoolingModel())
    pooling = pooling_req("p-5", 12, pooling_type)
    assert pooling.prompt_token_ids == warm.prompt_token_ids
    s.add_request(pooling)
    _, pooled, _ = run(s, PoolingModel())
    assert pooling.num_cached_tokens == hits
    assert pooled["p-5"] == [float(p) for p in range(hits, 12)]


def test_prompt_only_request_needs_blocks_for_its_prompt_alone():
    s = make_sched(num_blocks=4, block_size=4)
    s.add_request(pooling_req("p-1", 16))           # exactly the whole cache
    with pytest.raises(ValueError, match="KV cache holds only 4 blocks"):
        s.add_request(pooling_req("p-2", 17))
    _, pooled, _ = run(s, PoolingModel())
    assert list(pooled) == ["p-1"]


def test_missing_vector_fails_only_that_request():
    s = make_sched()
    s.add_request(pooling_req("p-1", 5))
    so = s.schedule()
    out = ModelRunnerOutput(list(so.num_scheduled_tokens), [[]])
    (core,) = s.update_from_output(so, out)
    assert core.finished and core.finish_reason == "error" and "pooled" in core.error
    assert s.recently_finished["p-1"].status == RequestStatus.FINISHED_ERROR
