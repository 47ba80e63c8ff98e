"""The Triton packed-weight GEMM (int8, int4 in the GGUF nibble layout, fp8) against the
dequantize-then-matmul reference, and the linear strategies with their Triton switch on; in
Triton's interpreter where there is no GPU. FP8 tensor cores are checked on a GPU only."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.layers.linear import Linear  # noqa: E402
from tokenmill.layers.quant import formats, triton_gemm  # noqa: E402
from tokenmill.layers.quant.matmul import reference_linear  # noqa: E402
from tokenmill.layers.quant.methods import FP8Method, Int4Method, Int8Method  # noqa: E402
from tokenmill.layers.quant.triton_gemm import (fp8_linear, fp8_scaled_mm_applies,  # noqa: E402
                                                packed_linear_triton, triton_packed_linear)


def _on(p: formats.Packed, device) -> formats.Packed:
    moved = {name: t.to(device) for name, t in p.tensors().items()}
    return replace(p, **moved)


def _weights(kind: str, n: int, k: int, group: int = 32, seed: int = 0) -> formats.Packed:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    if kind == "i8":
        return formats.quantize_int8(w)
    if kind == "f8":
        return formats.quantize_fp8(w)
    return formats.quantize_int4(w, group)


def _check(p, x, device, rtol=1e-5):
    want = reference_linear(x, p)
    got = triton_packed_linear(x.to(device), _on(p, device)).cpu()
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want.float(), rtol=rtol, atol=rtol * want.abs().max().item())


@pytest.mark.parametrize("kind, group", [("i8", 0), ("f8", 0), ("i4", 32), ("i4", 64)])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_matches_the_reference(triton_device, kind, group, m):
    p = _weights(kind, 40, 128, group)       # N = 40: a partial output tile
    x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m))
    _check(p, x, triton_device)


def test_per_channel_with_k_not_a_tile_multiple(triton_device):
    _check(_weights("i8", 24, 96), torch.randn(3, 96), triton_device)


def test_half_precision_scales_and_act_order(triton_device):
    p = _weights("i4", 32, 64, 32, seed=2)
    p = replace(p, scales=p.scales.half(), mins=p.mins.half(),
                perm=torch.randperm(64, generator=torch.Generator().manual_seed(1)))
    _check(p, torch.randn(2, 3, 64), triton_device)    # a leading batch dim too


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
def test_half_precision_activations(triton_device, dtype, tol):
    p = _weights("i4", 48, 64, 32)
    x = torch.randn(5, 64).to(dtype)
    want = reference_linear(x.float(), p)
    got = triton_packed_linear(x.to(triton_device), _on(p, triton_device)).cpu()
    # the weight tile is rounded to x's dtype for the dot (bf16: 8 bits, fp16: 11 bits)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("native", [True, False])
def test_every_e4m3_byte_decodes_exactly(triton_device, monkeypatch, native):
    # native: Triton's fp8 type (sm_89+, interpreter); else the bit decode of older GPUs
    monkeypatch.setattr(triton_gemm, "_fp8_native", lambda device: native)
    q = torch.arange(256, dtype=torch.int32)
    q[(q == 0x7F) | (q == 0xFF)] = 0          # the two NaNs are never stored
    q = q.to(torch.uint8).reshape(16, 16)
    p = formats.Packed("f8", q, torch.ones(16, 1), None, 16, 16, 16)
    eye = torch.eye(16, device=triton_device)    # y = x W^T with x = I gives W^T
    got = packed_linear_triton(eye, _on(p, triton_device)).cpu()
    torch.testing.assert_close(got, q.view(torch.float8_e4m3fn).float().t(), rtol=0, atol=0)


def test_no_rows_and_a_wrong_width(triton_device):
    p = _on(_weights("i8", 16, 32), triton_device)
    assert packed_linear_triton(torch.empty(0, 32, device=triton_device), p).shape == (0, 16)
    with pytest.raises(ValueError, match="features"):
        packed_linear_triton(torch.randn(2, 31, device=triton_device), p)


@pytest.mark.parametrize("method", [Int8Method(), Int4Method(32), FP8Method()])
def test_linear_methods_with_the_triton_switch(triton_device, method):
    torch.manual_seed(0)
    layer = Linear(64, 48, bias=True, quant_method=method)
    layer.weight.data.copy_(torch.randn(48, 64))
    layer.bias.data.copy_(torch.randn(48))
    method.process_weights_after_loading(layer)
    x = torch.randn(3, 64)
    want = layer(x)
    layer.to(triton_device)
    for part in layer.packed:   # the packed parts are plain tensors beside the parameters
        for name, t in part.tensors().items():
            setattr(part, name, t.to(triton_device))
    method.triton_kernels = True
    try:
        got = layer(x.to(triton_device)).cpu()
    finally:
        method.triton_kernels = False
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_fp8_tensor_cores_are_not_used_off_gpu():
    p = _weights("f8", 32, 64)
    assert not fp8_scaled_mm_applies(torch.randn(2, 64).bfloat16(), p)


def test_fp8_linear_arithmetic_on_cpu():
    # torch's CPU _scaled_mm takes the same row-wise scales: checks the quantization and
    # the operands' layout (a transposed x included) where there are no FP8 tensor cores
    p = _weights("f8", 48, 64)
    x = torch.randn(64, 5).bfloat16().t()
    got = fp8_linear(x, p)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 48)
    want = reference_linear(x.float(), p)
    assert (got.float() - want).norm() / want.norm() < 0.05


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or
                    torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores")
def test_fp8_scaled_mm_close_to_the_reference():
    p = _on(_weights("f8", 256, 512), "cuda")
    x = torch.randn(7, 512, device="cuda").bfloat16()
    assert fp8_scaled_mm_applies(x, p)
    want = reference_linear(x.float(), p)
    got = fp8_linear(x, p).float()
    # activations rounded to e4m3 (3 mantissa bits) per row: a few percent
    assert (got - want).norm() / want.norm() < 0.05
