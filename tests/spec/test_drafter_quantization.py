"""Drafters served from int8 weights (speculative_config "quantization": "int8"): every
trainable Linear takes its packed copy with q8 activations when autograd is off, computes
what the q8 reference computes, and training still sees the float weights."""
import pytest
import torch

from tokenmill.config import SpeculativeConfig
from tokenmill.layers.quant.matmul import reference_linear
from tokenmill.layers import cpu_ops
from tokenmill.spec.trainable import Linear, LinearGroup, RMSNorm, SwiGLU, quantize_linears


def _mlp():
    torch.manual_seed(0)
    mlp = SwiGLU(64, 96)
    odd = Linear(40, 8)      # 40 columns: not runs of 32, stays float
    return torch.nn.ModuleDict({"mlp": mlp, "odd": odd})


def test_linears_take_their_int8_copy_and_match_the_q8_reference():
    model = _mlp()
    x = torch.randn(3, 64)
    with torch.no_grad():
        float_out = model["mlp"](x)
    assert quantize_linears(model, "int8") == 3
    assert model["odd"].packed is None
    lin = model["mlp"].gate_proj
    with torch.no_grad():
        for rows in (1, 3, 20):   # decode rows and a GEMM-sized batch
            xs = torch.randn(rows, 64)
            torch.testing.assert_close(lin(xs), reference_linear(xs, lin.packed, activations="q8"),
                                       rtol=1e-5, atol=1e-5)
        out = model["mlp"](x)
    assert not torch.equal(out, float_out)                       # it is the int8 copy
    torch.testing.assert_close(out, float_out, rtol=0.05, atol=0.02)


def test_a_group_of_int8_linears_is_one_matmul_with_each_members_output():
    torch.manual_seed(1)
    members = [Linear(64, n, bias=b) for n, b in ((48, True), (16, False), (32, True))]
    group = LinearGroup(*members)
    x = torch.randn(5, 64)
    with torch.no_grad():
        float_out = group(x)       # not packed: each member on its own, side by side
        torch.testing.assert_close(float_out, torch.cat([m(x) for m in members], -1))
    quantize_linears(torch.nn.ModuleList(members), "int8")
    with torch.no_grad():
        for rows in (1, 5):
            xs = torch.randn(rows, 64)
            # the stacked rows are each member's int8 rows: the same q8 products, bit for bit
            assert torch.equal(group(xs), torch.cat([m(xs) for m in members], -1))
    assert group._stacked is not None and group._stacked[0].out_features == 96


def test_served_swiglu_and_norm_take_the_kernels_and_keep_the_math():
    model = _mlp()
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64) + 0.5)
    x = torch.randn(4, 64)
    with torch.no_grad():
        served_norm = norm(x)
    x_grad = x.clone().requires_grad_()
    torch.testing.assert_close(served_norm, norm(x_grad).detach(), rtol=1e-5, atol=1e-5)
    quantize_linears(model, "int8")
    mlp = model["mlp"]
    with torch.no_grad():
        fused = mlp(x)
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        separate = mlp.down_proj(torch.nn.functional.silu(gate) * up)
    torch.testing.assert_close(fused, separate, rtol=1e-4, atol=1e-5)
    if cpu_ops.available():   # one int8 matmul for gate and up
        assert mlp.gate_up._stacked is not None


def test_serving_keeps_no_float_copy_and_refuses_to_train():
    model = _mlp()
    quantize_linears(model, "int8")
    lin = model["mlp"].gate_proj
    assert lin.weight.numel() == 0 and lin.weight.dtype == torch.float32
    assert model["odd"].weight.shape == (8, 40)   # not converted: keeps its weight
    with pytest.raises(RuntimeError, match="train the float drafter"):
        model["mlp"](torch.randn(2, 64, requires_grad=True))


def test_config_rejects_what_it_cannot_quantize():
    assert SpeculativeConfig(method="eagle3", quantization="int8").quantization == "int8"
    with pytest.raises(ValueError, match="int8"):
        SpeculativeConfig(method="eagle3", quantization="int4")
    with pytest.raises(ValueError, match="eagle3 and dflash"):
        SpeculativeConfig(method="ngram", quantization="int8")
    with pytest.raises(ValueError, match="drafter quantization"):
        quantize_linears(_mlp(), "fp8")
