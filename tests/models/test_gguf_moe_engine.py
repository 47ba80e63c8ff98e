"""Mixture-of-Experts GGUF files through the whole engine: a tiny random HF model of each
architecture, written as llama.cpp's converter would (F32), gives HF ``generate``'s greedy
tokens and per-token logprobs within 1e-4 of HF float32; Q8_0 experts kept packed
(``quantization="gguf"``) give the greedy tokens of the same file expanded to floats."""
import pytest
import torch

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from tests.models.gguf_moe_writer import write_moe_gguf  # noqa: E402
from tests.models.test_tiny_architectures import (  # noqa: E402
    NUM_TOKENS, PROMPTS, _hf_greedy, _randomize_norms_and_biases)
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.layers.quant.checkpoint_methods import GGUFMethod  # noqa: E402

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              num_experts_per_tok=2)
# What GGUF can express (every layer sparse, no sliding window), else the shapes of
# test_moe_architectures: both settings of norm_topk_prob, a shared expert, head_dim != hidden /
# heads, OLMoE's qkv clip. Qwen3-MoE's expert width is a multiple of 32, Q8_0's block
# along the down projection's input.
ARCHS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, sliding_window=None)),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=6, moe_intermediate_size=32, shared_expert_intermediate_size=80, norm_topk_prob=False,
        use_sliding_window=False)),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=8, moe_intermediate_size=64, head_dim=32, norm_topk_prob=True, num_experts_per_tok=3)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, clip_qkv=2.5)),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1)


def build_hf(arch: str, directory) -> torch.nn.Module:
    """A seeded tiny model, norms and biases random too, saved to ``directory``."""
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**COMMON, **extra})).float().eval()
    _randomize_norms_and_biases(hf)
    hf.save_pretrained(directory, safe_serialization=True)
    return hf


def _generate(llm: LLM):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _llm(path: str, quantization=None) -> LLM:
    return LLM(model=path, skip_tokenizer_init=True, num_kv_blocks=64, block_size=4, quantization=quantization)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def f32(request, tmp_path_factory):
    arch, root = request.param, tmp_path_factory.mktemp(request.param)
    hf = build_hf(arch, root / "hf")
    path = str(root / "f32.gguf")
    write_moe_gguf(root / "hf", path, arch)
    return arch, hf, path, root


def test_f32_gguf_matches_hf_greedy_and_logprobs(f32):
    _, hf, path, _ = f32
    for prompt, out in zip(PROMPTS, _generate(_llm(path))):
        tokens = out.token_ids
        assert tokens == _hf_greedy(hf, prompt)
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0].float(), -1)
        for k, (tok, entry) in enumerate(zip(tokens, out.logprobs)):
            assert abs(entry[tok].logprob - ref[len(prompt) - 1 + k, tok].item()) < 1e-4, (k, tok)


def _expert_methods(llm: LLM) -> set[type]:
    """The linear strategies of the routed experts' projections."""
    return {type(m.quant_method) for name, m in llm.engine.model.named_modules()
            if ".experts." in name and hasattr(m, "quant_method")}


# Packed Q8_0 experts run the int8-weight matmul on float activations (the default
# quant_activations="fp32"); the expanded file runs the float matmul on the same dequantized
# values: the same function up to summation order. Measured max |logprob difference| over these
# 3 prompts x 16 tokens: 4.3e-6; 1e-4 is the suite's bound for a reordered reduction. Errors
# of the size of the quantization itself are far larger: Q8_0 against the F32 weights changes
# 2 of the 3 greedy continuations, and so do scales off by 2%.
Q8_TOL = 1e-4


@pytest.mark.parametrize("f32", ["qwen3moe"], indirect=True)
def test_packed_q8_experts_equal_the_dequantized_floats(f32):
    arch, _, _, root = f32
    path = str(root / "q8.gguf")
    write_moe_gguf(root / "hf", path, arch, quant="Q8_0")
    packed, floats = _llm(path, quantization="gguf"), _llm(path)
    # the test means something only if the experts really are packed in one and not the other
    assert _expert_methods(packed) == {GGUFMethod} and GGUFMethod not in _expert_methods(floats)
    worst = 0.0
    for a, b in zip(_generate(packed), _generate(floats)):
        assert a.token_ids == b.token_ids
        for tok, la, lb in zip(a.token_ids, a.logprobs, b.logprobs):
            worst = max(worst, abs(la[tok].logprob - lb[tok].logprob))
    assert worst < Q8_TOL
