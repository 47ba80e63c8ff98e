"""16-bit weights with float32 activations (quantization "bf16" / "fp16"): the kernels widen
each weight exactly and keep the float32 kernels' arithmetic, so the outputs are the float32
model's on the rounded weights, bit for bit, at any row count."""
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers import cpu_ops, native
from tokenmill.layers.quant import parse_quantization
from tokenmill.layers.quant.embedding import HalfEmbedding

pytestmark = pytest.mark.skipif(not native.buildable(), reason="no C compiler, or a CPU without AVX2")

HALVES = [torch.bfloat16, torch.float16]
# 1-8 rows stream W; 9-64 one blocked pass; 65+ chunks of 64 rows (prefill)
ROWS = [1, 2, 5, 8, 9, 17, 32, 63, 64, 65, 130]


def _float_kernel(x, w, b):
    """The float32 kernel on W widened (any row count: the C entry point takes them all)."""
    w = w.float().contiguous()
    y = torch.empty(x.shape[0], w.shape[0])
    native.require().tm_linear_small_m(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), w.shape[0],
                                       None if b is None else b.data_ptr(), y.data_ptr(), 2)
    return y


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("n,k", [(963, 100), (3072, 576), (577, 1536), (5, 3), (64, 640)])
def test_half_linear_has_the_float_kernels_bits_on_the_widened_weight(dtype, n, k):
    """N % 8 != 0 exercises the per-output sums, K % 8 != 0 the scalar tail, 130 rows the
    chunking; every row count gives the float32 kernel's bits, which do not depend on it."""
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(max(ROWS), k, generator=g)
    w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g)
    for bias in (None, b):
        whole = _float_kernel(x, w, bias)
        for m in ROWS:
            y = cpu_ops.linear_half(x[:m].contiguous(), w, bias)
            assert torch.equal(y, whole[:m]), m
    torch.testing.assert_close(whole, torch.nn.functional.linear(x.double(), w.double(), b.double()).float(),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not (native.has_vnni() and native.buildable()), reason="one build only here")
@pytest.mark.parametrize("dtype", HALVES)
def test_half_linear_both_builds_are_bit_identical(dtype, both_builds):
    g = torch.Generator().manual_seed(3)
    k, n = 200, 77
    x, w, b = torch.randn(70, k, generator=g), torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g)
    for m in (1, 7, 23, 70):
        outs = []
        for lib in both_builds:
            y = torch.empty(m, n)
            lib.tm_linear_half(x.data_ptr(), m, k, w.data_ptr(), cpu_ops.HALF_WEIGHT_CODES[dtype], n,
                               b.data_ptr(), y.data_ptr(), 2)
            outs.append(y)
        assert all(torch.equal(outs[0], y) for y in outs[1:]), m


def test_half_linear_declines_what_it_does_not_cover():
    w = torch.randn(16, 32).to(torch.bfloat16)
    assert cpu_ops.linear_half(torch.randn(2, 64)[:, ::2], w) is None                 # strided x
    assert cpu_ops.linear_half(torch.randn(2, 32), w.float()) is None                 # a float W
    assert cpu_ops.linear_half(torch.randn(2, 32, dtype=torch.float64), w) is None
    assert cpu_ops.linear_half(torch.randn(0, 32), w) is None
    assert cpu_ops.linear_half(torch.randn(2, 31), w) is None


def test_half_method_rounds_once_and_falls_back_without_kernels():
    from tokenmill.layers.linear import Linear
    from tokenmill.layers.quant.methods import HalfWeightMethod
    layer = Linear(48, 24, bias=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    rounded = layer.weight.data.to(torch.bfloat16)
    weight = layer.weight.data.clone()
    layer.set_quant_method(HalfWeightMethod("bf16"))
    layer.weight.data.copy_(weight)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.dtype is torch.bfloat16 and torch.equal(layer.weight, rounded)
    x = torch.randn(3, 48)
    y = layer(x)
    assert torch.equal(y, _float_kernel(x, rounded, layer.bias))
    layer.quant_method.cpu_kernels = False   # plain PyTorch: same values, other summation order
    torch.testing.assert_close(layer(x), y, rtol=1e-5, atol=1e-5)


def test_fp16_weights_refuse_values_beyond_its_range():
    from tokenmill.layers.linear import Linear
    from tokenmill.layers.quant.methods import HalfWeightMethod
    layer = Linear(8, 4, bias=False)
    layer.set_quant_method(HalfWeightMethod("fp16"))
    layer.weight.data.fill_(1.0)
    layer.weight.data[1, 2] = 7e4
    with pytest.raises(ValueError, match="float16's range"):
        layer.quant_method.process_weights_after_loading(layer)


def test_half_weights_are_spelled_bf16_and_fp16():
    assert parse_quantization("bf16").method == "bf16"
    assert parse_quantization("fp16").method == "fp16"
    with pytest.raises(ValueError, match="bf16, fp16"):
        parse_quantization("f16")


def _rounded_copy(src, dst, dtype):
    """The checkpoint with every linear weight and the embedding rounded to dtype, stored
    float32: what quantization=bf16 / fp16 runs, as plain float weights."""
    import shutil
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    tensors = load_file(f"{src}/model.safetensors")
    for name, t in tensors.items():
        if t.dim() == 2:   # q/k/v/o, gate/up/down, embed_tokens (tied: also the head)
            tensors[name] = t.to(dtype).float()
    save_file(tensors, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)


@pytest.mark.parametrize("quantization,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_a_half_weight_model_is_the_float_model_on_rounded_weights(tmp_path, quantization, dtype):
    """Same tokens and logprobs as float32 weights rounded beforehand, with a tied head read
    through the embedding's rows (no float table kept), on decode steps of 1 and 20 rows."""
    from tests.conftest import save_tiny_llama
    save_tiny_llama(tmp_path / "src", tie_word_embeddings=True, hidden_size=96, num_attention_heads=6,
                    num_key_value_heads=2, num_hidden_layers=2)
    ref_dir = _rounded_copy(tmp_path / "src", tmp_path / "rounded", dtype)
    prompts = [[(7 * i + 3 * j) % 384 for j in range(4 + i % 9)] for i in range(20)]
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True)

    def run(model, **kw):
        # steps of at most 64 rows: more would take oneDNN's copy in the float32 run
        llm = LLM(model=model, skip_tokenizer_init=True, enable_prefix_caching=False,
                  max_num_batched_tokens=64, **kw)
        outs = [llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
                for batch in (prompts[:1], prompts)]
        return llm, [o.outputs[0] for batch in outs for o in batch]
    half_llm, half = run(str(tmp_path / "src"), quantization=quantization)
    _, ref = run(ref_dir)
    model = half_llm.engine.model
    assert isinstance(model.model.embed_tokens, HalfEmbedding)
    assert model.lm_head.weight.dtype is dtype
    assert all(p.dtype is torch.float32 for n, p in model.named_parameters() if p.dim() == 1)
    for a, b in zip(half, ref):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert {t: v.logprob for t, v in la.items()} == {t: v.logprob for t, v in lb.items()}


def test_a_draft_vocabulary_head_over_16_bit_weights_keeps_float32_activations(tiny_llama_dir):
    """A drafter's reduced head (spec/draft_head.py) takes rows of a 16-bit head and scores
    float32 hidden states with the same kernel, so its logits are the target's own."""
    from tokenmill.spec.draft_head import DraftHead
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, quantization="bf16")
    target = llm.engine.model
    ids = torch.tensor([3, 7, 50, 51, 200, 383])
    hidden = torch.randn(9, target.args.hidden_size)
    head = DraftHead(target, ids)
    assert head.weight.dtype is torch.bfloat16
    logits = head.logits(hidden)
    assert logits.dtype is torch.float32
    assert torch.equal(logits, target.compute_logits(hidden)[:, ids])


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_weights_round_as_they_load_and_the_float32_parameter_is_never_written(name):
    """Each checkpoint tensor (fused shards too) goes straight into a 16-bit copy, so a
    model's float32 weights never all exist at once; the result is the rounded checkpoint."""
    from tests.models.test_weight_handover import TwoLinears
    from tokenmill.layers.quant.methods import HalfWeightMethod
    from tokenmill.models.weights import load_weights

    g = torch.Generator().manual_seed(1)
    tensors = {"proj.weight": torch.randn(4, 8, generator=g), "q_proj.weight": torch.randn(4, 8, generator=g),
               "k_proj.weight": torch.randn(2, 8, generator=g)}
    model = TwoLinears()
    for layer in (model.proj, model.qkv_proj):
        layer.set_quant_method(HalfWeightMethod(name))
        layer.weight.data.fill_(float("nan"))   # what an unwritten parameter would show
    load_weights(model, tensors.items())
    assert model.proj.weight.isnan().all() and model.qkv_proj.weight.isnan().all()
    for layer in (model.proj, model.qkv_proj):
        layer.quant_method.process_weights_after_loading(layer)
    dtype = torch.bfloat16 if name == "bf16" else torch.float16
    assert model.proj.weight.dtype == dtype
    assert torch.equal(model.proj.weight, tensors["proj.weight"].to(dtype))
    want = torch.cat([tensors["q_proj.weight"], tensors["k_proj.weight"]]).to(dtype)
    assert torch.equal(model.qkv_proj.weight, want)


def test_fp16_weights_refuse_values_past_its_range():
    from torch import nn
    from tokenmill.layers.linear import Linear
    from tokenmill.layers.quant.methods import HalfWeightMethod
    from tokenmill.models.weights import load_weights

    for value, fails in ((6e4, False), (7e4, True), (float("-inf"), True)):
        model = nn.Module()
        model.proj = Linear(4, 2)
        model.proj.set_quant_method(HalfWeightMethod("fp16"))
        weight = torch.ones(2, 4)
        weight[1, 2] = value
        load_weights(model, [("proj.weight", weight)])
        if fails:
            with pytest.raises(ValueError, match="beyond float16's range"):
                model.proj.quant_method.process_weights_after_loading(model.proj)
        else:
            model.proj.quant_method.process_weights_after_loading(model.proj)
            assert model.proj.weight[1, 2].item() == pytest.approx(6e4, rel=1e-3)
