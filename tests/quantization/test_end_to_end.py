"""Quantized models end to end on a tiny random Llama: online schemes stay close to fp32,
and GPTQ / AWQ / RTN / FP8 checkpoints written in AutoGPTQ / AutoAWQ layout load back with
the same dequantized weights."""
import os

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers.quant import formats
from tokenmill.models.loader import open_checkpoint
from tokenmill.quantization import writer
from tokenmill.quantization.quantize import QuantizeArgs, _quantize_tensors, linear_prefixes

PROMPTS = [[(13 * i + 7 * j) % 380 + 3 for j in range(n)] for i, n in enumerate([6, 17, 33])]


def _llm(path, quantization=None):
    return LLM(model=path, quantization=quantization, skip_tokenizer_init=True, num_kv_blocks=64)


def _run(llm, n=8):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def fp32_outputs(tiny_llama_dir):
    return _run(_llm(tiny_llama_dir))


@pytest.mark.parametrize("scheme,max_gap", [("int8", 0.1), ("fp8", 2.0), ("int4-g32", 2.0)])
def test_online_scheme_close_to_fp32(tiny_llama_dir, fp32_outputs, scheme, max_gap):
    """The quantized model's first greedy token is one fp32 also ranks near the top: within
    fp32's top 5 and at most ``max_gap`` below fp32's best logprob (this tiny random model has
    near-ties, so equal tokens alone would be a flaky criterion)."""
    llm = _llm(tiny_llama_dir, scheme)
    assert llm.get_memory_stats()["model_weights"] < _llm(tiny_llama_dir).get_memory_stats()["model_weights"]
    for o, r in zip(_run(llm), fp32_outputs):
        ref_top = r.logprobs[0]
        chosen = o.token_ids[0]
        assert chosen in ref_top
        assert max(v.logprob for v in ref_top.values()) - ref_top[chosen].logprob <= max_gap


@pytest.mark.parametrize("scheme", ["int8", "int4", "fp8"])
def test_kernel_path_equals_reference_path(tiny_llama_dir, scheme):
    """The whole model through the compiled kernel (float32 activations) vs through
    dequantize + F.linear."""
    from tokenmill.layers.linear import Linear
    llm = _llm(tiny_llama_dir, scheme)
    fast = _run(llm)
    for m in llm.engine.model.modules():
        if isinstance(m, Linear):
            m.quant_method.use_kernel = False
    ref = _run(llm)
    for a, b in zip(fast, ref):
        assert a.token_ids == b.token_ids
        assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4
                   for la, lb, t in zip(a.logprobs, b.logprobs, a.token_ids))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_q8_activation_kernel_stays_close_to_float_activations(tiny_llama_dir, scheme):
    """Int8-quantized activations vs float activations at the first output position (same
    context): the same greedy token and close logprobs. The tiny random model (weights
    ~N(0, 0.3)) amplifies activation rounding far more than a trained one; SmolLM2's
    perplexity through this path is measured by `tokenmill eval ppl --chunk-size 8
    --quant-activations q8`."""
    from tokenmill.layers.quant.methods import set_quant_activations
    llm = _llm(tiny_llama_dir, scheme)
    exact = _run(llm)
    set_quant_activations(llm.engine.model, "q8")
    q8 = _run(llm)
    assert [a.token_ids[0] for a in q8] == [b.token_ids[0] for b in exact]
    gaps = [abs(a.logprobs[0][t].logprob - b.logprobs[0][t].logprob)
            for a, b in zip(q8, exact) for t in b.logprobs[0] if t in a.logprobs[0]]
    assert max(gaps) < 0.25


def test_quant_activations_option_is_per_engine(tiny_llama_dir):
    """Two engines in one process with different ``quant_activations``: each computes with
    its own setting, whatever the other ran, and a fresh q8 engine computes the same again."""
    def q8_engine():   # no prefix cache: a hit would turn the last prompt token into a decode step
        return LLM(model=tiny_llama_dir, quantization="int4-g32", skip_tokenizer_init=True,
                   num_kv_blocks=64, quant_activations="q8", enable_prefix_caching=False)

    def logprobs(outs):
        return [[{t: v.logprob for t, v in pos.items()} for pos in o.logprobs] for o in outs]
    q8 = q8_engine()
    plain = _llm(tiny_llama_dir, "int4-g32")
    per_engine, plain_out = _run(q8), _run(plain)
    assert _run(q8) == per_engine   # after the fp32 engine ran
    assert logprobs(_run(q8_engine())) == logprobs(per_engine)
    assert logprobs(per_engine) != logprobs(plain_out)
    with pytest.raises(ValueError, match="quant_activations"):
        LLM(model=tiny_llama_dir, skip_tokenizer_init=True, quant_activations="int4")


class _FakeStats:
    """Calibration statistics from random correlated inputs (no tokenizer / data needed)."""

    def __init__(self, model, rows=256):
        from tokenmill.layers.linear import Linear
        from tokenmill.quantization.gptq import HessianAccumulator
        g = torch.Generator().manual_seed(0)
        self.hessians, self.samples = {}, {}
        for name, m in model.named_modules():
            if isinstance(m, Linear) and not name.endswith("lm_head"):
                k = m.in_features
                x = torch.randn(rows, 8, generator=g) @ torch.randn(8, k, generator=g) + 0.1 * torch.randn(rows, k, generator=g)
                acc = HessianAccumulator(k)
                acc.add(x)
                self.hessians[name], self.samples[name] = acc, [x]

    def sample(self, name):
        return torch.cat(self.samples[name])


@pytest.mark.parametrize("method,bits", [("rtn", 4), ("rtn", 8), ("gptq", 4), ("awq", 4), ("fp8", 8)])
def test_checkpoint_roundtrip(tiny_llama_dir, fp32_outputs, tmp_path, method, bits):
    engine = _llm(tiny_llama_dir).engine
    tensors = dict(open_checkpoint(tiny_llama_dir).iter_tensors())
    a = QuantizeArgs(model=tiny_llama_dir, method=method, output=str(tmp_path), bits=bits, group_size=32)
    written = _quantize_tensors(a, dict(tensors), linear_prefixes(engine.model), _FakeStats(engine.model), engine.model)
    qc = writer.quantization_config(method, bits, 32, sym=bits == 8)
    writer.write_checkpoint(str(tmp_path), open_checkpoint(tiny_llama_dir).hf_config, written, qc)
    llm = _llm(str(tmp_path))
    # the loaded layer holds exactly what the writer packed
    layer = llm.engine.model.model.layers[0].mlp.down_proj
    got = torch.cat([formats.dequantize(p) for p in layer.packed])
    expected = _dequantize_written(written, "model.layers.0.mlp.down_proj", method, bits)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    full = tensors["model.layers.0.mlp.down_proj.weight"]
    assert (got - full).abs().max() < (0.5 if bits == 4 else 0.1) * full.abs().max()
    outs = _run(llm)
    if method != "awq":   # AWQ's scales come from the fake statistics, not this model's inputs
        for o, r in zip(outs, fp32_outputs):   # picks a token fp32 ranks in its top 5
            assert o.token_ids[0] in r.logprobs[0]
    assert "quantization_config" in open(os.path.join(tmp_path, "config.json")).read()


def _dequantize_written(t, prefix, method, bits):
    """Independent decoding of the written tensors (AutoGPTQ / AutoAWQ conventions)."""
    from tokenmill.layers.quant.checkpoint_methods import awq_unpack, unpack_int32
    if method == "fp8":
        return t[prefix + ".weight"].float() * t[prefix + ".weight_scale"].float()
    scales = t[prefix + ".scales"].float()            # [groups, N]
    if method == "awq":
        q, z = awq_unpack(t[prefix + ".qweight"]), awq_unpack(t[prefix + ".qzeros"])   # [K, N], [g, N]
        g_idx = torch.arange(q.shape[0]) // 32
    else:
        q = unpack_int32(t[prefix + ".qweight"], bits, dim=0)                             # [K, N]
        z = (unpack_int32(t[prefix + ".qzeros"], bits, dim=1) + 1) & ((1 << bits) - 1)
        g_idx = t[prefix + ".g_idx"].long()
    return ((q.float() - z[g_idx].float()) * scales[g_idx]).t()
