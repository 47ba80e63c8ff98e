"""Every Linear strategy against its plain reference: RTN int8 / int4 / fp8 online, GPTQ and
AWQ checkpoint layouts (incl. act-order and fused shards), FP8 checkpoints, GGUF repacking."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers.linear import Linear, MergedLinear
from tokenmill.layers.quant import formats
from tokenmill.layers.quant.checkpoint_methods import (AWQMethod, FP8CheckpointMethod, GPTQMethod,
                                                       awq_pack, awq_unpack, pack_int32, unpack_int32)
from tokenmill.layers.quant.methods import FP8Method, Int4Method, Int8Method
from tokenmill.layers.quant.matmul import reference_linear
from tokenmill.quantization import writer
from tokenmill.quantization.gptq import HessianAccumulator, gptq, rtn

SHARDS = {"q": 64, "k": 32, "v": 32}


def _load(layer, named: dict, shard=None):
    for name, tensor in named.items():
        param = getattr(layer, name.rsplit(".", 1)[-1])
        param.weight_loader(param, tensor.to(param.dtype), shard, name=name)


def _merged(method):
    return MergedLinear(128, list(SHARDS.values()), list(SHARDS), quant_method=method)


def _forward_matches_reference(layer, x):
    y = layer(x)
    ref = torch.cat([reference_linear(x, p) for p in layer.packed], dim=-1)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    return y


def _dequantized(layer) -> torch.Tensor:
    return torch.cat([formats.dequantize(p) for p in layer.packed])


@pytest.mark.parametrize("method,tol", [(Int8Method(), 0.02), (Int4Method(32), 0.3),
                                        (Int4Method(128), 0.45), (FP8Method(), 0.13)])
def test_online_methods_on_fused_layer(method, tol):
    torch.manual_seed(0)
    layer = _merged(method)
    weights = {s: torch.randn(n, 128) for s, n in SHARDS.items()}
    for s, w in weights.items():
        _load(layer, {f"x.{s}_proj.weight": w}, shard=s)
    layer.quant_method.process_weights_after_loading(layer)
    assert "weight" not in dict(layer.named_parameters())
    full = torch.cat(list(weights.values()))
    assert (_dequantized(layer) - full).abs().max() < tol * full.abs().max()
    x = torch.randn(3, 128)
    y = _forward_matches_reference(layer, x)
    assert F.cosine_similarity(y.flatten(), F.linear(x, full).flatten(), dim=0) > 0.98


def test_unquantized_default_is_plain_linear():
    torch.manual_seed(0)
    layer = Linear(16, 8, bias=True)
    w, b = torch.randn(8, 16), torch.randn(8)
    _load(layer, {"l.weight": w, "l.bias": b})
    x = torch.randn(2, 16)
    torch.testing.assert_close(layer(x), F.linear(x, w, b))


def test_int32_packing_roundtrip():
    v = torch.randint(0, 16, (16, 24))
    assert torch.equal(unpack_int32(pack_int32(v, 4, 0), 4, 0), v)
    assert torch.equal(unpack_int32(pack_int32(v, 4, 1), 4, 1), v)
    v8 = torch.randint(0, 256, (8, 12))
    assert torch.equal(unpack_int32(pack_int32(v8, 8, 0), 8, 0), v8)
    assert torch.equal(awq_unpack(awq_pack(v)), v)
    # AWQ order: nibble j of a word holds column (0, 2, 4, 6, 1, 3, 5, 7)[j]
    word = int(awq_pack(torch.arange(8).reshape(1, 8))[0, 0])
    assert [(word >> (4 * j)) & 0xF for j in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]


def _hessian(k, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 8, generator=g) @ torch.randn(8, k, generator=g) + 0.1 * torch.randn(512, k, generator=g)
    acc = HessianAccumulator(k)
    acc.add(x)
    return acc.value()


@pytest.mark.parametrize("bits,act_order", [(4, False), (4, True), (8, False)])
def test_gptq_checkpoint_layout_roundtrip(bits, act_order):
    """Written as AutoGPTQ tensors, loaded shard by shard into a fused layer: the same
    dequantized weights, and the kernel path equals the reference."""
    torch.manual_seed(0)
    layer = _merged(GPTQMethod(bits, 32))
    expected = []
    for i, (s, n) in enumerate(SHARDS.items()):
        w = torch.randn(n, 128)
        qt = gptq(w, _hessian(128, seed=i if act_order else 0), bits, 32, sym=bits == 8, act_order=act_order)
        expected.append(qt.dequantize())
        _load(layer, writer.gptq_tensors(f"x.{s}_proj", qt), shard=s)
    layer.quant_method.process_weights_after_loading(layer)
    assert len(layer.packed) == (3 if act_order else 1)   # different act-orders: one part each
    torch.testing.assert_close(_dequantized(layer), torch.cat(expected), rtol=1e-6, atol=1e-6)
    _forward_matches_reference(layer, torch.randn(5, 128))


def test_awq_checkpoint_layout_roundtrip():
    torch.manual_seed(0)
    layer = Linear(128, 96, quant_method=AWQMethod(64))
    qt = rtn(torch.randn(96, 128), 4, 64)
    _load(layer, writer.awq_tensors("x.o_proj", qt))
    layer.quant_method.process_weights_after_loading(layer)
    torch.testing.assert_close(_dequantized(layer), qt.dequantize(), rtol=1e-6, atol=1e-6)
    _forward_matches_reference(layer, torch.randn(2, 128))


def test_fp8_checkpoint_roundtrip():
    torch.manual_seed(0)
    layer = _merged(FP8CheckpointMethod())
    expected = []
    for s, n in SHARDS.items():
        p = formats.quantize_fp8(torch.randn(n, 128))
        expected.append(formats.dequantize(p))
        tensors = writer.fp8_tensors(f"x.{s}_proj", p)
        for name, t in tensors.items():   # the safetensors loader hands floats over as fp32
            param = getattr(layer, name.rsplit(".", 1)[-1])
            param.weight_loader(param, t.float().to(param.dtype), s, name=name)
    layer.quant_method.process_weights_after_loading(layer)
    torch.testing.assert_close(_dequantized(layer), torch.cat(expected))
    _forward_matches_reference(layer, torch.randn(4, 128))


def _ggml_blocks(type_name, n, k, rng):
    """Random valid GGML bytes for an [n, k] tensor."""
    nb = n * k // 32
    d = rng.uniform(0.001, 0.05, size=(nb, 1)).astype(np.float16).view(np.uint8)
    if type_name == "Q8_0":
        body = rng.integers(-127, 128, size=(nb, 32)).astype(np.int8).view(np.uint8)
        return np.concatenate([d, body], axis=1).reshape(-1)
    body = rng.integers(0, 256, size=(nb, 16)).astype(np.uint8)
    if type_name == "Q4_0":
        return np.concatenate([d, body], axis=1).reshape(-1)
    m = rng.uniform(-0.2, 0.2, size=(nb, 1)).astype(np.float16).view(np.uint8)
    return np.concatenate([d, m, body], axis=1).reshape(-1)


@pytest.mark.parametrize("type_name,type_id", [("Q8_0", 8), ("Q4_0", 2), ("Q4_1", 3)])
def test_gguf_repack_equals_dequantize(type_name, type_id):
    from tokenmill.layers.quant.gguf import repack
    from tokenmill.models.loader.gguf_quants import dequantize
    rng = np.random.default_rng(0)
    n, k = 48, 128
    raw = _ggml_blocks(type_name, n, k, rng)
    parts = {key: torch.from_numpy(np.ascontiguousarray(v)) for key, v in repack(raw, type_name, (n, k)).items()}
    kind = "i8" if type_name == "Q8_0" else "i4"
    p = formats.Packed(kind, parts["qweight"], parts["scales"], parts.get("mins"), 32, n, k)
    expected = torch.from_numpy(dequantize(raw, type_id, (n, k)))
    torch.testing.assert_close(formats.dequantize(p), expected, rtol=0, atol=1e-6)
    x = torch.randn(2, k)
    from tokenmill.layers.quant.matmul import packed_linear
    torch.testing.assert_close(reference_linear(x, p), F.linear(x, expected), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed_linear(x, p), reference_linear(x, p),
                               rtol=1e-4, atol=1e-4)
