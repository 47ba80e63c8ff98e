"""LLMEngine.warmup (run by LLM at start-up) pays one-time costs and leaves no trace."""
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig
from tokenmill.engine.llm_engine import LLMEngine

PROMPTS = [[5, 17, 33, 2, 9, 41, 7] * 3, [3, 3, 8]]


def _greedy(llm_or_engine):
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    ids = [engine.add_request(None, {"prompt_token_ids": p}, params) for p in PROMPTS]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[i] for i in ids]


def test_warmup_leaves_counters_cache_and_outputs_untouched(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=32)   # warmed up
    stats, memory = llm.get_stats(), llm.get_memory_stats()
    assert stats["num_generated_tokens"] == 0 and stats["prefix_cache_queries"] == 0
    assert memory["num_free_blocks"] == memory["num_total_blocks"]
    assert llm.engine.scheduler.kv.pool.reset_prefix_cache()   # nothing cached, nothing held
    cold = LLMEngine(EngineConfig(model=ModelConfig(model=tiny_llama_dir, skip_tokenizer_init=True),
                                  cache=CacheConfig(num_kv_blocks=32)))
    assert _greedy(llm) == _greedy(cold)
    assert llm.get_stats()["prefix_cache_hits"] == 0   # no warmup block was reused


def test_warmup_refuses_a_busy_engine(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=32)
    llm.engine.add_request(None, {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle"):
        llm.engine.warmup()
