"""AsyncEngine.call from a caller that gives up: the engine thread survives and serves on."""
import concurrent.futures
import threading

from tokenmill import SamplingParams
from tokenmill.engine.async_engine import AsyncEngine


def test_a_cancelled_call_does_not_kill_the_engine_thread(tiny_llama_dir):
    from tokenmill.entrypoints.llm import LLM
    engine = AsyncEngine(lambda: LLM(model=tiny_llama_dir, skip_tokenizer_init=True,
                                     num_kv_blocks=32).engine)
    engine.start()
    assert engine.ready.wait(60) and engine.load_error is None
    try:
        gate, ran = threading.Event(), []
        blocker = engine.call(lambda eng: gate.wait(10))   # holds the engine thread
        cancelled = engine.call(lambda eng: ran.append(1))
        assert cancelled.cancel()                           # the caller gives up first
        gate.set()
        assert blocker.result(10) is True
        assert engine.call(lambda eng: eng.has_unfinished_requests()).result(10) is False
        assert ran == [] and engine._thread.is_alive()
        try:
            cancelled.result(0)
        except concurrent.futures.CancelledError:
            pass
        ids = engine.call(lambda eng: eng.add_request(None, {"prompt_token_ids": [1, 2, 3]},
                                                      SamplingParams(max_tokens=2))).result(10)
        assert ids is not None
    finally:
        engine.stop()
