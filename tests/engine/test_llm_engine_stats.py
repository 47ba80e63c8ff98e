"""``llm.llm_engine.get_stats()`` / ``get_memory_stats()``: the monitoring snippet of the first
source article runs as written, and each key means what it says."""
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine.stats import free_memory_bytes, module_bytes

PROMPTS = [{"prompt_token_ids": [5, 17, 33, 2, 9]}, {"prompt_token_ids": [3, 3, 8, 1]},
           {"prompt_token_ids": [7, 11]}]
MAX_TOKENS = 6


def _llm(model_dir):
    return LLM(model=model_dir, skip_tokenizer_init=True, num_kv_blocks=32)


def _generate(llm):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate(PROMPTS, params, use_tqdm=False)


def test_article_snippet_runs_as_written(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=32)
    llm.generate({"prompt_token_ids": [5, 17, 33]}, SamplingParams(max_tokens=4), use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    mem = llm.llm_engine.get_memory_stats()
    print(f"requests {stats['num_requests']}, tokens {stats['num_generated_tokens']}, "
          f"latency {stats['avg_latency_ms']:.1f} ms, "
          f"{stats['throughput_tokens_per_sec']:.1f} tok/s")
    print(f"KV {mem['kv_cache_usage']:.1%}, weights {mem['model_weights'] / 1e6:.1f} MB, "
          f"free {mem['free_memory'] / 1e9:.1f} GB")


def test_llm_engine_is_the_engine_and_read_only(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    assert llm.llm_engine is llm.engine
    try:
        llm.llm_engine = None
    except AttributeError:
        pass
    else:
        raise AssertionError("llm_engine should be read-only")
    assert llm.llm_engine.get_stats().keys() == llm.get_stats().keys()


def test_stats_count_what_was_generated(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    outputs = _generate(llm)
    stats = llm.llm_engine.get_stats()
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert generated == len(PROMPTS) * MAX_TOKENS
    assert stats["num_requests"] == len(PROMPTS)
    assert stats["num_generated_tokens"] == generated
    assert stats["num_prompt_tokens"] == sum(len(p["prompt_token_ids"]) for p in PROMPTS)
    assert stats["avg_latency_ms"] > 0
    busy = llm.engine.stats.busy_time
    assert abs(stats["throughput_tokens_per_sec"] - generated / busy) < 1e-6 * generated / busy
    for key in ("avg_ttft_ms", "num_preemptions", "prefix_cache_hit_rate", "prefix_cache_hits"):
        assert key in stats   # the older keys stay


def test_memory_stats_keys_and_ranges(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    idle = llm.llm_engine.get_memory_stats()
    assert idle["kv_cache_usage"] == 0.0 and idle["kv_cache_usage_perc"] == 0.0
    params = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
    assert idle["model_weights"] == module_bytes(llm.engine.model)
    assert idle["model_weights"] == llm.engine.weight_bytes >= params   # buffers (RoPE tables) too
    # a decode step streams every float parameter but the embedding table (tied or not:
    # this model's head has its own) and no RoPE table
    model = llm.engine.model
    embed = model.model.embed_tokens.weight
    tied = model.lm_head.weight.data_ptr() == embed.data_ptr()
    assert llm.engine.decode_read_bytes == params - (0 if tied else embed.numel() * embed.element_size())
    assert idle["free_memory"] > 0
    for key in ("kv_cache", "kv_capacity_tokens", "num_free_blocks", "num_total_blocks"):
        assert key in idle   # the older keys stay


def test_kv_cache_usage_is_a_fraction_of_blocks_in_use(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request(None, {"prompt_token_ids": list(range(1, 40))}, params)
    engine.step()   # the prefill holds its blocks
    mem = engine.get_memory_stats()
    used = mem["num_total_blocks"] - mem["num_free_blocks"]
    assert 0 < mem["kv_cache_usage"] <= 1
    assert mem["kv_cache_usage"] == used / mem["num_total_blocks"]
    assert abs(mem["kv_cache_usage_perc"] - 100 * mem["kv_cache_usage"]) < 1e-9
    while engine.has_unfinished_requests():
        engine.step()


def test_free_memory_on_cpu_is_system_available_memory():
    free = free_memory_bytes(torch.device("cpu"))
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert free > 0 and abs(free - avail) < max(avail // 10, 64 * 1024**2)
