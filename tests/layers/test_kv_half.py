"""Half-precision KV caches (kv_cache_dtype fp16 / bf16): half the bytes of float32, values
rounded on write and widened in the attention kernels' registers. The kernels themselves are
checked against the reference in test_cpu_ops.py and test_llama_fused.py; here the names and
the end-to-end fidelity against a float32 cache."""
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.runner.kv_tensors import bytes_per_block, kv_storage_dtype

PROMPTS = [[(11 * i + 3 * j) % 380 + 3 for j in range(n)] for i, n in enumerate([7, 30, 3])]


def test_names_and_sizes():
    for name, dtype in [("fp16", torch.float16), ("float16", torch.float16),
                        ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16)]:
        assert kv_storage_dtype(name, torch.float32) is dtype
    assert bytes_per_block(2, 16, 2, 64, torch.bfloat16) * 2 == \
        bytes_per_block(2, 16, 2, 64, torch.float32)


@pytest.fixture(scope="module")
def fp32_outputs(tiny_llama_dir):
    return _run(tiny_llama_dir, "auto")


def _run(model_dir, kv_cache_dtype):
    llm = LLM(model=model_dir, skip_tokenizer_init=True, num_kv_blocks=64, block_size=16,
              kv_cache_dtype=kv_cache_dtype)
    assert llm.engine.kv_dtype is kv_storage_dtype(kv_cache_dtype, torch.float32)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


@pytest.mark.parametrize("kv_cache_dtype, tol, min_same", [("fp16", 1e-2, 12), ("bf16", 5e-2, 6)])
def test_close_to_a_float32_cache(tiny_llama_dir, fp32_outputs, kv_cache_dtype, tol, min_same):
    """Greedy tokens agree for at least ``min_same`` tokens (this tiny random model has near
    ties that bf16's 8 bits can flip), and while the histories agree the chosen tokens'
    logprobs stay within ``tol`` (prefill reads the rounded cache too, as decode does: a
    prompt's rows then do not depend on how it was chunked or cached; fp16 measured 5.2e-3)."""
    for got, want in zip(_run(tiny_llama_dir, kv_cache_dtype), fp32_outputs):
        ours, theirs = got.outputs[0].token_ids, want.outputs[0].token_ids
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(theirs))
        assert same >= min_same
        for g, w, tok in list(zip(got.outputs[0].logprobs, want.outputs[0].logprobs,
                                  theirs))[:same]:
            assert abs(g[tok].logprob - w[tok].logprob) < tol
