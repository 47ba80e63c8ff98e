"""Scheduler tests with a pure-Python stand-in model: the next token is a function of the
request's whole token history, so any scheduling bug (lost/duplicated tokens, wrong resume
point) changes the output."""
import pytest

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.outputs import ModelRunnerOutput
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams
from tokenmill.kv.layout import KVLayout
from tokenmill.sched.scheduler import Scheduler

VOCAB = 1000
EOS = 0


class HistoryModel:
    """Stands in for the runner: tracks what it has computed per request and emits
    next = hash(all tokens) % VOCAB once a request's tokens are all computed."""

    def __init__(self):
        self.computed: dict[str, list[int]] = {}

    def execute(self, sched, so):
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.computed.pop(rid, None)
        for new in so.scheduled_new_reqs:
            assert new.num_computed_tokens % sched.kv.block_size == 0 or new.num_computed_tokens == 0
            self.computed[new.req_id] = (new.prompt_token_ids + new.output_token_ids)[:new.num_computed_tokens]
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            req = sched.requests[rid]
            have = self.computed[rid]
            assert len(have) == req.num_computed_tokens, "runner and scheduler disagree"
            have.extend(req.all_token_ids[len(have):len(have) + n])
            req_ids.append(rid)
            if len(have) == req.num_tokens:
                sampled.append([1 + (sum(t * (i + 7) for i, t in enumerate(have)) % (VOCAB - 1))])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids, sampled)


def make_sched(num_blocks=64, block_size=4, max_seqs=8, budget=32, policy="fcfs", caching=True):
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, policy=policy),
                     CacheConfig(block_size=block_size, enable_prefix_caching=caching),
                     KVLayout.single(num_blocks), max_model_len=256)


def req(rid, n_prompt, max_tokens=6, priority=0, arrival=None, **kw):
    params = SamplingParams(max_tokens=max_tokens, **kw).with_engine_stops(None)
    prompt = [(7 * int(rid.split("-")[-1]) + 3 * i) % (VOCAB - 1) + 1 for i in range(n_prompt)]
    return Request(rid, prompt, params, max_tokens, arrival_time=arrival, priority=priority)


def run(sched, model, max_steps=10_000):
    outputs = {}
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        steps.append(so)
        ro = model.execute(sched, so)
        for out in sched.update_from_output(so, ro):
            outputs.setdefault(out.req_id, []).extend(out.new_token_ids)
    assert not sched.has_unfinished_requests(), "scheduler hung"
    return outputs, steps


def reference_outputs(specs):
    out = {}
    for rid, n_prompt, max_tokens in specs:
        s = make_sched(num_blocks=256, budget=4096)
        s.add_request(req(rid, n_prompt, max_tokens))
        out.update(run(s, HistoryModel())[0])
    return out


SPECS = [(f"r-{i}", 3 + 5 * i % 37, 4 + i % 5) for i in range(12)]


def test_batch_and_chunking_give_same_tokens_as_alone():
    ref = reference_outputs(SPECS)
    s = make_sched(budget=16)
    for spec in SPECS:
        s.add_request(req(*spec))
    outputs, steps = run(s, HistoryModel())
    assert outputs == ref
    assert all(so.total_num_scheduled_tokens <= 16 for so in steps)
    assert all(len(so.num_scheduled_tokens) <= 8 for so in steps)
    assert s.kv.num_free_blocks == s.kv.num_total_blocks and s.kv.num_tracked_requests == 0


def test_preemption_recomputes_and_matches():
    ref = reference_outputs(SPECS)
    s = make_sched(num_blocks=14, budget=64)
    for spec in SPECS:
        s.add_request(req(*spec))
    outputs, _ = run(s, HistoryModel())
    assert outputs == ref
    assert s.num_preemptions > 0
    assert s.kv.num_free_blocks == s.kv.num_total_blocks


def test_priority_policy_serves_lower_value_first():
    s = make_sched(max_seqs=1, policy="priority")
    s.add_request(req("r-1", 4, priority=5, arrival=1.0))
    s.add_request(req("r-2", 4, priority=0, arrival=2.0))
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["r-2"]


def test_fcfs_serves_arrival_order():
    s = make_sched(max_seqs=1)
    s.add_request(req("r-1", 4, arrival=2.0))
    s.add_request(req("r-2", 4, arrival=1.0))
    assert list(s.schedule().num_scheduled_tokens) == ["r-2"]


def test_request_that_can_never_fit_is_rejected_at_admission():
    s = make_sched(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="KV cache holds only 4 blocks"):
        s.add_request(req("r-1", 10, max_tokens=10))
    s.add_request(req("r-2", 8, max_tokens=4))   # the queue behind it still works
    outputs, _ = run(s, HistoryModel())
    assert len(outputs["r-2"]) == 4


def test_stop_token_and_min_tokens():
    ref = reference_outputs([("r-1", 5, 6)])["r-1"]
    s = make_sched()
    stop_tok = ref[1]
    s.add_request(req("r-1", 5, 6, stop_token_ids=[stop_tok]))
    outputs, _ = run(s, HistoryModel())
    assert outputs["r-1"] == ref[:2]
    s = make_sched()
    s.add_request(req("r-1", 5, 6, stop_token_ids=[ref[0]], min_tokens=3))
    outputs, _ = run(s, HistoryModel())
    assert outputs["r-1"][0] == ref[0] and len(outputs["r-1"]) > 1


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "decoding", "preempted"])
def test_abort_in_each_state_leaves_others_identical(when):
    ref = reference_outputs(SPECS)
    s = make_sched(num_blocks=14 if when == "preempted" else 64, budget=8)
    for spec in SPECS:
        s.add_request(req(*spec))
    model = HistoryModel()
    outputs = {}
    victim = None
    for _ in range(10_000):
        if not s.has_unfinished_requests():
            break
        if victim is None:
            victim = _find(s, when)
            if victim is not None:
                s.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
        so = s.schedule()
        for out in s.update_from_output(so, model.execute(s, so)):
            outputs.setdefault(out.req_id, []).extend(out.new_token_ids)
    assert victim is not None
    for rid, toks in ref.items():
        if rid != victim:
            assert outputs[rid] == toks
    assert s.kv.num_free_blocks == s.kv.num_total_blocks and not s.requests


def _find(s, when):
    for r in list(s.requests.values()):
        if when == "waiting" and r.status == RequestStatus.WAITING and r.num_computed_tokens == 0:
            return r.request_id
        if when == "mid_prefill" and r.status == RequestStatus.RUNNING and 0 < r.num_computed_tokens < r.num_prompt_tokens:
            return r.request_id
        if when == "decoding" and r.status == RequestStatus.RUNNING and r.num_output_tokens > 0:
            return r.request_id
        if when == "preempted" and r.status == RequestStatus.PREEMPTED:
            return r.request_id
    return None


def test_prefix_cache_hit_skips_computation():
    s = make_sched(budget=256)
    s.add_request(req("r-1", 17, 2))
    run(s, HistoryModel())
    s.add_request(req("r-2", 1, 2))  # unrelated
    r = req("r-1", 17, 2)
    r.request_id = "again"
    s.add_request(r)
    so = s.schedule()
    assert so.num_scheduled_tokens["again"] == 1     # 16 tokens served by the cache
    assert r.num_cached_tokens == 16


class FailingModel(HistoryModel):
    """Raises (as a failed step would) whenever the poisoned request is in the step with
    ``at`` output tokens."""

    def __init__(self, poisoned: str, at: int):
        super().__init__()
        self.poisoned, self.at = poisoned, at

    def execute(self, sched, so):
        req = sched.requests.get(self.poisoned)
        if self.poisoned in so.num_scheduled_tokens and req.num_output_tokens == self.at:
            return None
        return super().execute(sched, so)


def test_failed_step_isolates_its_requests_and_fails_only_the_culprit():
    specs = [("r-1", 9, 6), ("r-2", 5, 6), ("r-3", 7, 6)]
    expected = reference_outputs(specs)
    s, model = make_sched(num_blocks=32, budget=64), FailingModel("r-2", at=2)
    for rid, n, m in specs:
        s.add_request(req(rid, n, m))
    outputs, alone_steps, errors = {}, 0, {}
    while s.has_unfinished_requests():
        so = s.schedule()
        if s.suspects:
            assert len(so.num_scheduled_tokens) == 1   # a suspect always runs alone
            alone_steps += 1
        ro = model.execute(s, so)
        outs = s.update_from_output(so, ro) if ro is not None else \
            s.recover_failed_step(so, "boom")
        for out in outs:
            outputs.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.error:
                errors[out.req_id] = out.error
    assert errors == {"r-2": "boom"} and outputs["r-2"] == expected["r-2"][:2]
    assert outputs["r-1"] == expected["r-1"] and outputs["r-3"] == expected["r-3"]
    assert alone_steps >= 3 and s.num_preemptions == 0 and not s.suspects
    assert s.kv.num_free_blocks == s.kv.num_total_blocks
