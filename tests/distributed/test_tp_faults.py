"""Failed steps with tensor-parallel ranks: a rule firing on every rank fails only its
request (the ranks answer the failed step and stay up); a rank killed mid-step fails the
engine with WorkerFailedError at once, leaving no process behind."""
import multiprocessing
import time

import pytest

from tokenmill.config import CacheConfig, EngineConfig, FaultRule, ModelConfig, ParallelConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.runner.executor import WorkerFailedError
from tokenmill.sampling_params import SamplingParams
from tests.distributed.test_tensor_parallel import tied_llama_dir  # noqa: F401 (fixture)

TRIGGER = (251, 252)
PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [3, 3, 8, 251, 252, 9], [12, 40, 11, 6, 6, 1, 30]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _engine(model, tp, rules=()):
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=model, skip_tokenizer_init=True),
        cache=CacheConfig(block_size=4, num_kv_blocks=64),
        parallel=ParallelConfig(tensor_parallel_size=tp), fault_injection=tuple(rules)))


def _run(engine):
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [done[f"r{i}"] for i in range(len(PROMPTS))]


def _rank_processes():
    return [c for c in multiprocessing.active_children() if c.name.startswith("tokenmill-tp")]


def test_tp2_step_failure_fails_only_its_request(tied_llama_dir):
    single = _engine(tied_llama_dir, 1)
    reference = [o.token_ids for o in _run(single)]
    engine = _engine(tied_llama_dir, 2, [FaultRule("forward_error", TRIGGER, at_output_token=2)])
    try:
        outs = _run(engine)
        assert outs[1].finish_reason == "error" and len(outs[1].token_ids) == 2
        assert [outs[0].token_ids, outs[2].token_ids] == [reference[0], reference[2]]
        assert engine.get_stats()["num_failed_steps"] >= 2
        assert all(p.is_alive() for p in engine.executor.procs)
        assert engine.get_memory_stats()["num_free_blocks"] == 64
    finally:
        engine.shutdown()


def test_tp2_rank_killed_mid_step_fails_fast(tied_llama_dir):
    engine = _engine(tied_llama_dir, 2, [FaultRule("kill_worker", TRIGGER, at_output_token=3,
                                                   ranks=(1,))])
    procs = list(engine.executor.procs)
    start = time.monotonic()
    with pytest.raises(WorkerFailedError, match="rank 1"):
        _run(engine)
    assert time.monotonic() - start < 30   # no collective timeout (120 s) waited out
    engine.shutdown()
    assert not any(p.is_alive() for p in procs)
    assert _rank_processes() == []
