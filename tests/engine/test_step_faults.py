"""A step that raises fails only the request that caused it: the engine re-runs the step's
requests alone (recompute) to find it, the others finish with exactly the tokens of a run
without the fault, and nothing leaks. Faults come from the test-only FaultRule hook, on the
real runner code path."""
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config import FaultRule

TRIGGER = (251, 252, 253)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)


def _prompts():
    clean = [[(7 * i + j) % 240 + 3 for j in range(9 + 3 * i)] for i in range(4)]
    faulty = clean[1][:5] + list(TRIGGER) + clean[1][5:]
    return clean, faulty


def _llm(model_dir, rules=(), **kw):
    args = dict(model=model_dir, skip_tokenizer_init=True, num_kv_blocks=96, block_size=4,
                max_num_batched_tokens=24, fault_injection=rules)
    args.update(kw)
    return LLM(**args)


def _run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    clean, faulty = _prompts()
    llm = _llm(tiny_llama_dir)
    return {name: [c.token_ids for c in _run(llm, [faulty] + clean, params)]
            for name, params in (("greedy", GREEDY), ("seeded", SEEDED))}


def _assert_no_leak(llm):
    mem = llm.get_memory_stats()
    assert mem["num_free_blocks"] == mem["num_total_blocks"]
    assert not llm.engine.scheduler.suspects and not llm.engine.runner.states


@pytest.mark.parametrize("kind", ["forward_error", "sample_error", "nan_logits"])
@pytest.mark.parametrize("at", [0, 3])
def test_a_failing_request_fails_alone(tiny_llama_dir, reference, kind, at):
    clean, faulty = _prompts()
    llm = _llm(tiny_llama_dir, [FaultRule(kind, TRIGGER, at_output_token=at)])
    outs = _run(llm, [faulty] + clean, GREEDY)
    assert outs[0].finish_reason == "error" and outs[0].error
    assert len(outs[0].token_ids) == at   # the tokens before the fault stand
    assert [o.token_ids for o in outs[1:]] == reference["greedy"][1:]
    assert all(o.finish_reason == "length" for o in outs[1:])
    stats = llm.get_stats()
    if kind != "nan_logits":   # NaN rows are caught per request, without failing the step
        assert stats["num_failed_steps"] >= 2   # the batch, then the request alone
        assert "InjectedFault" in outs[0].error
    assert stats["num_preemptions"] == 0          # isolation is not counted as preemption
    _assert_no_leak(llm)
    # the engine goes on serving
    assert [c.token_ids for c in _run(llm, clean, GREEDY)] == reference["greedy"][1:]


def test_a_transient_fault_costs_only_time(tiny_llama_dir, reference):
    """Fires once: the batch fails, each request re-runs alone and all finish exactly."""
    clean, faulty = _prompts()
    rule = FaultRule("forward_error", TRIGGER, at_output_token=4, max_fires=1)
    llm = _llm(tiny_llama_dir, [rule])
    outs = _run(llm, [faulty] + clean, SEEDED)
    assert [o.token_ids for o in outs] == reference["seeded"]
    assert llm.get_stats()["num_failed_steps"] == 1
    _assert_no_leak(llm)


def test_isolation_under_preemption_and_chunking(tiny_llama_dir, reference):
    """A pool too small for the batch: preemptions and chunked prefills mix with the
    isolation steps, and the clean requests still match the reference."""
    clean, faulty = _prompts()
    llm = _llm(tiny_llama_dir, [FaultRule("forward_error", TRIGGER, at_output_token=2)],
               num_kv_blocks=14, max_num_batched_tokens=8)
    outs = _run(llm, [faulty] + clean, SEEDED)
    assert outs[0].finish_reason == "error"
    assert [o.token_ids for o in outs[1:]] == reference["seeded"][1:]
    assert llm.get_stats()["num_preemptions"] > 0
    _assert_no_leak(llm)


def test_every_step_failing_stops_the_engine(tiny_llama_dir):
    """Failures nothing explains (each request alone fails too, step after step) mean the
    engine is broken: after max_failed_steps_in_a_row it raises instead of failing every
    request forever."""
    clean, _ = _prompts()
    rule = FaultRule("forward_error", tuple(clean[0][:2]))
    llm = _llm(tiny_llama_dir, [rule], max_failed_steps_in_a_row=3)
    for _ in range(2):   # one request at a time: each failure counts
        assert _run(llm, clean[:1], GREEDY)[0].finish_reason == "error"
    with pytest.raises(RuntimeError, match="3 steps failed in a row"):
        _run(llm, clean[:1], GREEDY)


def test_suspects_that_fail_alone_do_not_trip_the_breaker(tiny_llama_dir, reference):
    """Several faulty requests in one batch: each fails alone, the clean ones finish."""
    clean, faulty = _prompts()
    llm = _llm(tiny_llama_dir, [FaultRule("forward_error", TRIGGER)], max_failed_steps_in_a_row=2)
    faulty_many = [faulty, faulty[::-1][:4] + list(TRIGGER), list(TRIGGER) + [5, 6]]
    outs = _run(llm, faulty_many + clean, GREEDY)
    assert [o.finish_reason for o in outs[:3]] == ["error"] * 3
    assert [o.token_ids for o in outs[3:]] == reference["greedy"][1:]
    _assert_no_leak(llm)


def test_fault_rule_validation():
    with pytest.raises(ValueError, match="fault kind"):
        FaultRule("explode", (1,))
    with pytest.raises(ValueError, match="trigger_token_ids"):
        FaultRule("forward_error", ())
    with pytest.raises(ValueError, match="at_output_token"):
        FaultRule("forward_error", (1,), at_output_token=-1)
