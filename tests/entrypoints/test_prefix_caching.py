"""Prefix caching end to end on a tiny random Llama: same outputs with the cache on or off,
cold or warm, under eviction and preemption; salts isolate; blocks all return."""
import pytest

from tokenmill import LLM, SamplingParams

BASE = [(11 * j) % 370 + 7 for j in range(48)]           # a 48-token shared "system prompt"
PROMPTS = [BASE + [(5 * i + j) % 370 + 3 for j in range(3 + 4 * i)] for i in range(8)]


def _llm(path, **kw):
    kw.setdefault("num_kv_blocks", 128)
    return LLM(model=path, skip_tokenizer_init=True, block_size=8, **kw)


def _tokens(llm, prompts, params, salt=None):
    outs = llm.generate([{"prompt_token_ids": p, "cache_salt": salt} for p in prompts], params,
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_k=50, seed=3, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    off = _llm(tiny_llama_dir, enable_prefix_caching=False)
    return {name: _tokens(off, PROMPTS, p)[0] for name, p in (("greedy", GREEDY), ("seeded", SEEDED))}


@pytest.mark.parametrize("name,params", [("greedy", GREEDY), ("seeded", SEEDED)])
def test_cold_and_warm_equal_cache_off(tiny_llama_dir, reference, name, params):
    llm = _llm(tiny_llama_dir)
    cold, _ = _tokens(llm, PROMPTS, params)
    warm, cached = _tokens(llm, PROMPTS, params)
    assert cold == reference[name] and warm == reference[name]
    assert all(c >= 48 for c in cached)          # the shared prefix (6 blocks of 8) was reused
    stats = llm.get_stats()
    assert stats["prefix_cache_hits"] > 0 and 0 < stats["prefix_cache_hit_rate"] <= 1
    mem = llm.get_memory_stats()
    assert mem["num_free_blocks"] == mem["num_total_blocks"]


def test_forced_eviction_and_preemption_change_nothing(tiny_llama_dir, reference):
    llm = _llm(tiny_llama_dir, num_kv_blocks=14, max_num_batched_tokens=32)
    for _ in range(2):
        assert _tokens(llm, PROMPTS, GREEDY)[0] == reference["greedy"]
    assert llm.engine.scheduler.kv.pool.num_evictions > 0
    assert llm.get_stats()["num_preemptions"] > 0
    mem = llm.get_memory_stats()
    assert mem["num_free_blocks"] == mem["num_total_blocks"]


def test_different_salts_never_share(tiny_llama_dir, reference):
    llm = _llm(tiny_llama_dir)
    _, cached = _tokens(llm, PROMPTS[:1], GREEDY, salt="alice")
    assert cached == [0]
    toks, cached = _tokens(llm, PROMPTS[:1], GREEDY, salt="bob")
    assert cached == [0] and toks == reference["greedy"][:1]
    _, cached = _tokens(llm, PROMPTS[:1], GREEDY, salt="alice")
    assert cached[0] >= 48


def test_bad_salt_type_is_rejected(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": [5, 6], "cache_salt": 12}], GREEDY, use_tqdm=False)
