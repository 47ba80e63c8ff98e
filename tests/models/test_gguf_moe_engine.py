"""Mixture-of-Experts GGUF files through the whole engine: a tiny random HF model of each
architecture, written as llama.cpp's converter would (F32), gives HF ``generate``'s greedy
tokens and per-token logprobs within 1e-4 of HF float32; Q8_0 experts kept packed
(``quantization="gguf"``) give the greedy tokens of the same file expanded to floats."""
import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from tests.models.gguf_moe_writer import write_moe_gguf  # noqa: E402
from tests.models.test_moe_architectures import build_tiny_moe  # noqa: E402
from tests.models.test_tiny_architectures import NUM_TOKENS, PROMPTS, assert_matches_hf  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.layers.quant.checkpoint_methods import GGUFMethod  # noqa: E402

# What GGUF can express (every layer sparse, no sliding window), else the shapes of
# test_moe_architectures: both settings of norm_topk_prob, a shared expert, head_dim != hidden /
# heads, OLMoE's qkv clip. Qwen3-MoE's expert width is a multiple of 32, Q8_0's block
# along the down projection's input. GGUF architecture -> (test_moe_architectures name, changes)
ARCHS = {
    "mixtral": ("mixtral", dict(sliding_window=None)),
    "qwen2moe": ("qwen2_moe", dict(mlp_only_layers=[], use_sliding_window=False)),
    "qwen3moe": ("qwen3_moe", dict(moe_intermediate_size=64)),
    "olmoe": ("olmoe", {}),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1)


def build_hf(arch: str, directory) -> torch.nn.Module:
    name, overrides = ARCHS[arch]
    return build_tiny_moe(name, directory, **overrides)


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
    assert_matches_hf(hf, _llm(path))


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
