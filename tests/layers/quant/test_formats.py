"""Packed formats and the compiled kernel against the plain-PyTorch reference."""
import numpy as np
import pytest
import torch

from tokenmill.layers.quant import formats as F
from tokenmill.layers import native
from tokenmill.layers.quant import kernels
from tokenmill.layers.quant.matmul import packed_linear, quantize_activations_q8, reference_linear

# Skipped only where the kernel cannot exist; where it should, a failed build fails the test.
needs_kernel = pytest.mark.skipif(not native.buildable(), reason="no C compiler, or a CPU without AVX2")

SHAPES = [(96, 64, 32), (64, 256, 128), (200, 576, 64), (33, 1536, 32)]   # N, K, group


def _packed(kind, w, group):
    if kind == "i8":
        return F.quantize_int8(w)
    if kind == "i8g16":   # int8 with 16-value groups, as GGUF Q6_K repacks
        group = 16
    if kind in ("i8g", "i8g16", "i8m"):   # grouped int8, as GGUF Q8_0 repacks
        q = F.quantize_int8(w)
        mins = torch.randn(w.shape[0], w.shape[1] // group) if kind == "i8m" else None   # Q5_1 / Q5_K
        return F.Packed("i8", q.qweight, torch.rand(w.shape[0], w.shape[1] // group) + 0.1,
                        mins, group, *w.shape)
    if kind == "i4":
        return F.quantize_int4(w, group)
    return F.quantize_fp8(w)


def test_int4_pack_roundtrip():
    q = torch.randint(0, 16, (7, 96), dtype=torch.uint8)
    packed = F.pack_int4(q)
    assert packed.shape == (7, 48)
    assert torch.equal(F.unpack_int4(packed), q)
    # GGUF layout: byte j of a 32-run holds value j (low nibble) and j + 16 (high nibble)
    assert int(packed[0, 0]) == int(q[0, 0]) | (int(q[0, 16]) << 4)


@pytest.mark.parametrize("n,k,group", SHAPES)
def test_rtn_error_within_half_step(n, k, group):
    torch.manual_seed(0)
    w = torch.randn(n, k)
    p8 = F.quantize_int8(w)
    assert (F.dequantize(p8) - w).abs().le(p8.scales / 2 + 1e-6).all()
    p4 = F.quantize_int4(w, group)
    step = p4.scales.repeat_interleave(group, dim=1)
    assert (F.dequantize(p4) - w).abs().le(step / 2 + 1e-5).all()


def test_fp8_matches_torch_cast():
    torch.manual_seed(0)
    w = torch.randn(16, 64)
    p = F.quantize_fp8(w)
    expected = (w / p.scales).to(torch.float8_e4m3fn).float() * p.scales
    assert torch.equal(F.dequantize(p), expected)


def test_pick_group_size():
    assert F.pick_group_size(576, 128) == 64
    assert F.pick_group_size(1536, 128) == 128
    assert F.pick_group_size(576, 32) == 32


@needs_kernel
@pytest.mark.parametrize("kind", ["i8", "i8g", "i8g16", "i8m", "i4", "f8"])
@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("mode", ["fp32", "q8"])
def test_kernel_matches_reference(kind, n, k, group, rows, mode):
    torch.manual_seed(n + k + rows)
    w = torch.randn(n, k)
    p = _packed(kind, w, group)
    x = torch.randn(rows, k)
    ref = reference_linear(x, p, activations=mode)
    got = packed_linear(x, p, kernel_max_rows=64, activations=mode)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@needs_kernel
def test_kernel_activation_quantization_equals_reference():
    torch.manual_seed(5)
    x = torch.randn(3, 96) * torch.tensor([0.01, 1.0, 300.0]).repeat_interleave(32)
    x[1, 32:64] = 0.0   # an all-zero run: scale 0, values 0
    q, d = kernels.quantize_q8(x)
    torch.testing.assert_close(q.float() * d.repeat_interleave(32, dim=1), quantize_activations_q8(x),
                               rtol=0, atol=0)
    assert q.abs().max() <= 127


@needs_kernel
def test_q8_activations_stay_close_to_float():
    torch.manual_seed(6)
    w, x = torch.randn(64, 256), torch.randn(2, 256)
    p = F.quantize_int4(w, 32)
    exact = reference_linear(x, p)
    q8 = reference_linear(x, p, activations="q8")
    assert (q8 - exact).abs().max() < 0.02 * exact.abs().max()


@needs_kernel
def test_kernel_with_column_permutation_and_bias():
    """GPTQ act-order: columns stored sorted by group, x permuted to match."""
    torch.manual_seed(1)
    w = torch.randn(64, 128)
    perm = torch.randperm(128)
    p = F.quantize_int4(w[:, perm], 32)
    p.perm = perm
    x, bias = torch.randn(3, 128), torch.randn(64)
    torch.testing.assert_close(packed_linear(x, p, bias),
                               reference_linear(x, p, bias),
                               rtol=1e-4, atol=1e-4)
    # the reference undoes the permutation: it dequantizes close to the original weight
    assert (F.dequantize(p) - w).abs().max() < 0.5


def test_fallback_path_equals_reference():
    torch.manual_seed(2)
    w = torch.randn(40, 96)
    p = F.quantize_int4(w, 32)
    x = torch.randn(5, 96)
    torch.testing.assert_close(packed_linear(x, p, use_kernel=False), reference_linear(x, p))


@needs_kernel
@pytest.mark.parametrize("kind", ["i8", "i8g", "i8g16", "i8m", "i4", "f8"])
def test_compiled_dequant_equals_reference(kind):
    torch.manual_seed(3)
    w = torch.randn(72, 256)
    p = _packed(kind, w, 64)
    got = kernels.dequant({"i8": 0, "i4": 1, "f8": 2}[p.kind], p.qweight, p.scales, p.mins,
                          p.group_size, p.out_features, p.in_features)
    torch.testing.assert_close(got, F.dequantize_stored(p), rtol=1e-6, atol=1e-6)
    x = torch.randn(40, 256)   # many rows: the dequantize + GEMM path
    torch.testing.assert_close(packed_linear(x, p), reference_linear(x, p), rtol=1e-4, atol=1e-4)
