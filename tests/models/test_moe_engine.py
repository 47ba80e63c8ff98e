"""The engine's promises on an MoE model (tiny Qwen2-MoE: shared expert, a dense layer):
batch and chunked-prefill invariance, preemption and prefix caching change no token; and the
whole MoE path on real weights: SmolLM2 upcycled with identical experts is dense SmolLM2."""
import numpy as np
import pytest

from tokenmill import LLM, SamplingParams
from tests.entrypoints.openai.conftest import smollm2_path  # noqa: F401 (fixture)
from tests.models.test_moe_architectures import build_tiny_moe

PROMPTS = [[(11 * i + 5 * j) % 240 + 4 for j in range(n)] for i, n in enumerate([9, 30, 17, 4, 23])]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_moe")
    build_tiny_moe("qwen2_moe", path)
    return str(path)


def generate(llm, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs]


def same(a, b, atol=1e-4):
    for (ta, la), (tb, lb) in zip(a, b, strict=True):
        assert ta == tb
        np.testing.assert_allclose(la, lb, atol=atol, rtol=0)


@pytest.fixture(scope="module")
def alone(moe_dir):
    """Each prompt on its own, no prefix cache: the reference."""
    llm = LLM(model=moe_dir, skip_tokenizer_init=True, num_kv_blocks=128, block_size=4,
              enable_prefix_caching=False)
    return [generate(llm, [p])[0] for p in PROMPTS]


def test_batched_and_chunked_prefill_give_the_same_tokens(moe_dir, alone):
    llm = LLM(model=moe_dir, skip_tokenizer_init=True, num_kv_blocks=128, block_size=4,
              max_num_batched_tokens=16, enable_prefix_caching=False)   # 30-token prompt in chunks
    same(generate(llm, PROMPTS), alone)


def test_preemption_changes_no_token(moe_dir, alone):
    llm = LLM(model=moe_dir, skip_tokenizer_init=True, num_kv_blocks=14, block_size=4,
              enable_prefix_caching=False)
    same(generate(llm, PROMPTS), alone)
    assert llm.llm_engine.get_stats()["num_preemptions"] > 0


def test_prefix_cache_hits_change_no_token(moe_dir, alone):
    llm = LLM(model=moe_dir, skip_tokenizer_init=True, num_kv_blocks=128, block_size=4)
    generate(llm, PROMPTS)
    again = generate(llm, PROMPTS)
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] > 0
    same(again, alone)


@pytest.mark.slow
def test_upcycled_smollm2_with_identical_experts_is_dense_smollm2(smollm2_path, tmp_path):
    from tokenmill.models.upcycle import UpcycleConfig, upcycle
    out = tmp_path / "smollm2-moe"
    upcycle(smollm2_path, str(out), UpcycleConfig(num_experts=4, top_k=2))
    prompts = [[1, 504, 3458, 314, 4704, 30], [1, 2683, 253, 1345, 282], list(range(100, 140))]
    dense = LLM(model=smollm2_path, skip_tokenizer_init=True, num_kv_blocks=64, max_model_len=256)
    expected = generate(dense, prompts)
    del dense
    moe = LLM(model=str(out), skip_tokenizer_init=True, num_kv_blocks=64, max_model_len=256)
    got = generate(moe, prompts)
    same(got, expected)
    load = moe.llm_engine.get_stats()["moe"]
    assert load["num_layers"] == 30 and load["routed"] > 0
