"""A closed batch draining (LLM.generate once nothing waits): adaptive k drafts only for the
requests with the most tokens left, and values a step by how much closer the batch's end came.
Tokens other requests gain early do not shorten the call, and their rows cost every step."""
from tokenmill import LLM, SamplingParams
from tokenmill.spec.adaptive import AdaptiveK, _bucket
from tokenmill.spec.decoder import _path_verdict


def test_path_verdict():
    # the ending request (10 left) took 3 drafts and kept 2; the other one emitted 1
    assert _path_verdict({"a": 10, "b": 8}, {"a": 3, "b": 1}, {"a": 3}) == (3, 2)
    # it got 4 ahead, but "b", one token behind it, emitted 1: the end came 2 closer
    assert _path_verdict({"a": 10, "b": 9}, {"a": 4, "b": 1}, {"a": 3}) == (3, 1)
    # two ending requests: the end comes as close as the slower one's tokens
    assert _path_verdict({"a": 10, "b": 10}, {"a": 4, "b": 1}, {"a": 3, "b": 3}) == (3, 0)
    assert _path_verdict({"a": 10, "b": 10}, {"a": 3, "b": 2}, {"a": 3, "b": 2}) == (2, 1)
    # prompt lookup found nothing for the ending request: a step without drafts
    assert _path_verdict({"a": 10, "b": 7}, {"a": 1, "b": 3}, {"b": 3}) == (0, 0)
    # the ending request finishes: the end is now the other one, which came 1 closer
    assert _path_verdict({"a": 3, "b": 2}, {"a": 3, "b": 1}, {"a": 2}) == (2, 1)


def test_draining_arms_are_apart_except_at_one_request():
    assert _bucket(8, True) != _bucket(8, False) and _bucket(1, True) == _bucket(1, False)
    ctl = AdaptiveK(3)
    for _ in range(300):
        # steady batch of 8: every request keeps its drafts, verification is cheap -> speculate
        k, _ = ctl.choose(8)
        ctl.record(8, k, 1.0 + 0.05 * k, [(k, k)] * 8 if k else [])
        # the same batch draining: its end never comes closer faster than a token a step
        k, _ = ctl.choose(8, draining=True)
        ctl.record(8, k, 1.0 + 0.05 * k, [(k, 0)] if k else [], draining=True)
    assert ctl._best(_bucket(8, False))[1] > 0
    assert ctl._best(_bucket(8, True))[1] == 0


class AlwaysTwo:
    """Controller stub: k = 2 every step (the decoder still applies its draining rule)."""

    def choose(self, batch_size, draining=False):
        return 2, 0

    def record(self, *args, **kwargs):
        pass

    def estimated_speedup(self):
        return 0.0


def _drafted_for(llm) -> list:
    """Wraps the proposer: the (request, drafts asked) of every drafting call, with the
    draining flag of the step it drafts after."""
    spec = llm.engine.runner.spec
    spec.controller = AlwaysTwo()
    calls, propose, after_step = [], spec.proposer.propose, spec.after_step
    flags = []

    def recording(inp):
        calls.extend((s.req_id, n, flags[-1]) for s, n in zip(inp.states, inp.num_drafts))
        return propose(inp)

    def after(runner, so, *args, **kwargs):
        flags.append(so.draining)
        return after_step(runner, so, *args, **kwargs)
    spec.proposer.propose, spec.after_step = recording, after
    return calls


def test_a_draining_batch_drafts_for_its_end_only(looping_llama_dir):
    prompts = [{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}, {"prompt_token_ids": [9, 3, 9, 3, 9, 3]}]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (6, 40)]
    plain = LLM(model=looping_llama_dir, skip_tokenizer_init=True, num_kv_blocks=64, num_threads=1)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]

    def spec_llm(adaptive):
        return LLM(model=looping_llama_dir, skip_tokenizer_init=True, num_kv_blocks=64, num_threads=1,
                   speculative_config=dict(method="ngram", num_speculative_tokens=2,
                                           adaptive=adaptive, prompt_lookup_min=1))
    llm = spec_llm(True)
    calls = _drafted_for(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert not llm.engine.scheduler.arrivals_closed          # closed for the call only
    short, long = [o.request_id for o in outs]
    both = [c for c in calls if c[2]]                          # steps while the batch drained
    assert both and all(n == 0 for r, n, _ in both if r == short)
    assert any(n > 0 for r, n, _ in both if r == long)

    # requests added one by one and stepped (a server's way): never draining, every request
    # gets its drafts; and with fixed k the rule does not apply either
    for adaptive in (True, False):
        llm = spec_llm(adaptive)
        calls = _drafted_for(llm)
        if adaptive:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                llm.engine.add_request(f"r{i}", p, sp)
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
            short = "r0"
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == want
            short = outs[0].request_id
        assert any(n > 0 for r, n, _ in calls if r == short), adaptive
