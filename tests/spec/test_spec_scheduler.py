"""Scheduler-level speculative decoding with plain Python (no torch): a stand-in target whose
next token is a function of the whole history, and a stand-in drafter that is right for a
varying number of positions. Checks rollback by count, budget / max_tokens trimming,
preemption, and that the prefix cache never keys a block holding unverified tokens."""
import pytest

from tests.sched.test_scheduler import VOCAB, make_sched, reference_outputs, req
from tokenmill.outputs import ModelRunnerOutput


def next_token(history):
    return 1 + (sum(t * (i + 7) for i, t in enumerate(history)) % (VOCAB - 1))


class SpecHistoryModel:
    """Runner stand-in: keeps the tokens whose KV it holds, verifies drafts greedily (accept
    while the draft equals the target's next token), rolls back rejected KV, and proposes
    k drafts of which the first ``(step + len) % (k + 1)`` are right."""

    def __init__(self, k=3, wrong=False):
        self.k, self.wrong, self.step = k, wrong, 0
        self.computed: dict[str, list[int]] = {}
        self.num_accepted = self.num_drafts = 0

    def execute(self, sched, so):
        self.step += 1
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.computed.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.computed[new.req_id] = (new.prompt_token_ids + new.output_token_ids)[:new.num_computed_tokens]
        req_ids, sampled, drafts_out = [], [], {}
        for rid, n in so.num_scheduled_tokens.items():
            r = sched.requests[rid]
            have = self.computed[rid]
            assert len(have) == r.num_computed_tokens, "runner and scheduler disagree"
            drafts = so.scheduled_spec_token_ids.get(rid, [])
            assert drafts == r.spec_token_ids[:len(drafts)]
            have.extend((r.all_token_ids + drafts)[len(have):len(have) + n])
            req_ids.append(rid)
            if len(have) < r.num_tokens:
                sampled.append([])
                continue
            out = self._verify(have, r.num_tokens, drafts)
            sampled.append(out)
            drafts_out[rid] = self._propose(r.all_token_ids + out)
        return ModelRunnerOutput(req_ids, sampled, draft_token_ids=drafts_out)

    def _verify(self, have, num_verified, drafts):
        out = []
        for j in range(len(drafts) + 1):
            t = next_token(have[:num_verified + j])
            out.append(t)
            if j == len(drafts) or drafts[j] != t:
                break
        self.num_drafts += len(drafts)
        self.num_accepted += len(out) - 1
        del have[num_verified + len(out) - 1:]    # rejected drafts' KV is garbage
        return out

    def _propose(self, tokens):
        num_right = 0 if self.wrong else (self.step + len(tokens)) % (self.k + 1)
        drafts, seq = [], list(tokens)
        for j in range(self.k):
            t = next_token(seq)
            drafts.append(t if j < num_right else (t % (VOCAB - 1)) + 1)
            seq.append(drafts[-1])
        return drafts


def run(sched, model):
    outputs = {}
    for _ in range(10_000):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        assert so.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
        for out in sched.update_from_output(so, model.execute(sched, so)):
            outputs.setdefault(out.req_id, []).extend(out.new_token_ids)
        _check_cache_keys(sched, outputs)
    assert not sched.has_unfinished_requests(), "scheduler hung"
    return outputs


def _check_cache_keys(sched, outputs):
    """Every cached block's tokens are a verified block of some request's true sequence."""
    verified = {}
    for rid, r in list(sched.requests.items()) + list(sched.recently_finished.items()):
        toks = r.all_token_ids
        bs = sched.kv.block_size
        for i in range(len(toks) // bs):
            verified[tuple(toks[i * bs:(i + 1) * bs])] = True
    for block in sched.kv.pool.blocks:
        if block.block_hash is not None and block.ref_cnt > 0:
            assert block.block_hash.token_ids in verified
    sched.recently_finished.clear()


SPECS = [(f"r-{i}", 3 + 5 * i % 37, 4 + 3 * i % 11) for i in range(12)]


@pytest.mark.parametrize("budget,num_blocks,lookahead", [(64, 64, 0), (9, 64, 3), (64, 16, 3)])
def test_spec_outputs_equal_plain_and_rollback_matches(budget, num_blocks, lookahead):
    ref = reference_outputs(SPECS)
    s = make_sched(num_blocks=num_blocks, budget=budget)
    s.num_lookahead_tokens = lookahead
    for spec in SPECS:
        s.add_request(req(*spec))
    model = SpecHistoryModel(k=3)
    assert run(s, model) == ref
    assert model.num_accepted > 0 and model.num_drafts > model.num_accepted
    assert s.kv.num_free_blocks == s.kv.num_total_blocks and s.kv.num_tracked_requests == 0
    if num_blocks == 16:
        assert s.num_preemptions > 0


def test_always_wrong_drafts_still_give_plain_output():
    ref = reference_outputs(SPECS)
    s = make_sched()
    for spec in SPECS:
        s.add_request(req(*spec))
    model = SpecHistoryModel(k=4, wrong=True)
    assert run(s, model) == ref
    assert model.num_accepted == 0 and model.num_drafts > 0


def test_drafts_trimmed_to_max_tokens_and_budget():
    s = make_sched(budget=64)
    r = req("r-1", 5, max_tokens=3)
    s.add_request(r)
    so = s.schedule()
    s.update_from_output(so, ModelRunnerOutput(["r-1"], [[11]], draft_token_ids={"r-1": [1, 2, 3, 4]}))
    assert r.spec_token_ids == [1]        # 1 output + 1 draft + 1 bonus = max_tokens
    so = s.schedule()
    assert so.num_scheduled_tokens["r-1"] == 2 and so.scheduled_spec_token_ids["r-1"] == [1]
    # draft rejected: one recovered token, num_computed_tokens rolled back by one
    computed = r.num_computed_tokens
    s.update_from_output(so, ModelRunnerOutput(["r-1"], [[7]], draft_token_ids={"r-1": [9, 9]}))
    assert r.num_computed_tokens == computed + 1 == r.num_tokens - 1
    assert r.output_token_ids == [11, 7] and r.spec_token_ids == []   # no room for drafts
    s2 = make_sched(budget=3)
    r2 = req("r-2", 2, max_tokens=20)
    s2.add_request(r2)
    so = s2.schedule()
    s2.update_from_output(so, ModelRunnerOutput(["r-2"], [[5]], draft_token_ids={"r-2": [1, 2, 3, 4]}))
    so = s2.schedule()
    assert so.num_scheduled_tokens["r-2"] == 3 and so.scheduled_spec_token_ids["r-2"] == [1, 2]


def test_stop_token_inside_accepted_drafts_finishes_there():
    s = make_sched()
    r = req("r-1", 5, max_tokens=20, stop_token_ids=[42])
    s.add_request(r)
    so = s.schedule()
    s.update_from_output(so, ModelRunnerOutput(["r-1"], [[11]], draft_token_ids={"r-1": [3, 42, 5]}))
    so = s.schedule()
    outs = s.update_from_output(so, ModelRunnerOutput(["r-1"], [[3, 42, 5, 6]]))
    assert outs[0].new_token_ids == [3, 42] and outs[0].finished and outs[0].finish_reason == "stop"
    assert s.kv.num_free_blocks == s.kv.num_total_blocks


def test_short_pool_drops_drafts_before_preempting():
    s = make_sched(num_blocks=2, block_size=4, budget=64)
    s.num_lookahead_tokens = 4
    r = req("r-1", 6, max_tokens=2)
    s.add_request(r)
    so = s.schedule()
    s.update_from_output(so, ModelRunnerOutput(["r-1"], [[11]], draft_token_ids={"r-1": [1, 2, 3]}))
    assert r.spec_token_ids == []   # max_tokens 2 leaves no room for a draft
    r.spec_token_ids = [1]          # force one: 8 tokens fit, 8 + lookahead do not
    so = s.schedule()
    assert so.num_scheduled_tokens["r-1"] == 2 and not so.preempted_req_ids
