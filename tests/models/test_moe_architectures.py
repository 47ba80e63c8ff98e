"""Each Mixture-of-Experts architecture, as a tiny random model saved by transformers: greedy
continuations equal HF ``generate`` and per-token logprobs are within 1e-4 of HF float32;
the expert load statistics count every routed (token, expert) pair."""
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tests.models.test_tiny_architectures import PROMPTS, _randomize_norms_and_biases, assert_matches_hf

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              num_experts_per_tok=2)

ARCHS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, sliding_window=8)),
    # norm_topk_prob off, one dense layer in the middle, a shared expert
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=6, moe_intermediate_size=32, shared_expert_intermediate_size=80,
        mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=8, moe_intermediate_size=48, head_dim=32, norm_topk_prob=True, num_experts_per_tok=3)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, clip_qkv=2.5)),
}


def build_tiny_moe(name, path, **overrides):
    """The seeded tiny ``name`` model of ARCHS (config fields replaced by ``overrides``),
    saved to ``path`` and read back by transformers."""
    import transformers
    config_cls, model_cls, extra = ARCHS[name]
    cfg = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(cfg).float().eval()
    _randomize_norms_and_biases(hf)
    hf.save_pretrained(path, safe_serialization=True)
    return getattr(transformers, model_cls).from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = build_tiny_moe(request.param, path)
    llm = LLM(model=str(path), skip_tokenizer_init=True, num_kv_blocks=64, block_size=4)
    return request.param, hf, llm


def test_greedy_and_logprobs_match_hf(tiny):
    _, hf, llm = tiny
    assert_matches_hf(hf, llm)


def test_expert_load_counts_every_routed_token(tiny):
    name, hf, llm = tiny
    engine = llm.llm_engine
    engine.reset_expert_load()
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    fresh = [[(t + 101) % 250 + 3 for t in p] for p in PROMPTS]   # nothing in the prefix cache
    llm.generate([{"prompt_token_ids": p} for p in fresh], params, use_tqdm=False)
    moe = engine.get_stats()["moe"]
    cfg = hf.config
    sparse = 2 if name == "qwen2_moe" else 3
    assert moe["num_layers"] == sparse and moe["num_experts"] == (
        getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    # every prompt token and every generated token but the last goes through each MoE layer once
    tokens = sum(len(p) for p in PROMPTS) + len(PROMPTS) * 4
    for row in moe["counts"]:
        assert sum(row) == tokens * cfg.num_experts_per_tok
    assert moe["routed"] == sparse * tokens * cfg.num_experts_per_tok and moe["dropped"] == 0
    assert all(v >= 1.0 for v in moe["imbalance"])
