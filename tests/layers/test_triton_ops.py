"""The fused Triton ops (RMSNorm with residual, SiLU / GELU-tanh gates, RoPE) against the
PyTorch modules they stand in for, fp32 and bf16, odd sizes; in Triton's interpreter where
there is no GPU (tests/conftest.py), so shapes stay small."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.layers import triton_ops  # noqa: E402
from tokenmill.layers.activation import GeluTanhAndMul, SiluAndMul  # noqa: E402
from tokenmill.layers.norm import GemmaRMSNorm, RMSNorm  # noqa: E402
from tokenmill.layers.rotary import RotaryEmbedding  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def _plain(module):
    module.cpu_kernels = False
    module.triton_kernels = False
    return module


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("n", [64, 100])
def test_rms_norm_and_add(triton_device, dtype, norm_cls, n):
    gen = torch.Generator().manual_seed(n)
    norm = _plain(norm_cls(n, eps=1e-5))
    norm.weight.data = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(3, n, generator=gen).to(dtype)
    update = torch.randn(3, n, generator=gen).to(dtype)
    want = norm(x)
    want_out, want_sum = norm.add_and_norm(update.clone(), x)
    w = norm.weight.to(triton_device)
    got = triton_ops.rms_norm(x.to(triton_device), w, 1e-5, gemma=norm.gemma)
    got_out, got_sum = triton_ops.rms_norm(update.to(triton_device), w, 1e-5,
                                           residual=x.to(triton_device), gemma=norm.gemma)
    torch.testing.assert_close(got.cpu(), want, **_tol(dtype))
    torch.testing.assert_close(got_out.cpu(), want_out, **_tol(dtype))
    if dtype == torch.float32:
        assert torch.equal(got_sum.cpu(), want_sum)      # the residual stream: exact
    else:   # the interpreter rounds fp32 -> bf16 toward zero (a GPU to nearest): one ulp
        torch.testing.assert_close(got_sum.cpu(), want_sum, rtol=2**-7, atol=0)


def test_rms_norm_of_a_strided_view_and_no_rows(triton_device):
    norm = _plain(RMSNorm(48))
    wide = torch.randn(4, 96)
    view = wide[:, 8:56]                     # rows 96 apart, columns contiguous
    got = triton_ops.rms_norm(view.to(triton_device), norm.weight.to(triton_device), 1e-6)
    torch.testing.assert_close(got.cpu(), norm(view.contiguous()), rtol=1e-5, atol=1e-5)
    empty = torch.empty(0, 48, device=triton_device)
    assert triton_ops.rms_norm(empty, norm.weight.to(triton_device), 1e-6).shape == (0, 48)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act_cls, op", [(SiluAndMul, triton_ops.silu_mul),
                                         (GeluTanhAndMul, triton_ops.gelu_tanh_mul)])
@pytest.mark.parametrize("inter", [24, 1100])
def test_gated_activations(triton_device, dtype, act_cls, op, inter):
    x = (torch.randn(3, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 3).to(dtype)
    want = _plain(act_cls())(x)
    got = op(x.to(triton_device))
    torch.testing.assert_close(got.cpu(), want, **_tol(dtype))
    assert op(torch.empty(0, 2 * inter, dtype=dtype, device=triton_device)).shape == (0, inter)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place(triton_device, dtype):
    rope = _plain(RotaryEmbedding(32, 64, 10000.0))
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 7, 32, generator=gen).to(dtype)    # q, k as strided views
    q, k = qkv[:, :4], qkv[:, 4:6]
    positions = torch.tensor([0, 3, 63, 17, 5])
    want_q, want_k = rope(positions, q.clone(), k.clone())
    qkv_dev = qkv.to(triton_device)
    q_dev, k_dev = qkv_dev[:, :4], qkv_dev[:, 4:6]
    triton_ops.rope_(q_dev, k_dev, rope.cos.to(triton_device), rope.sin.to(triton_device),
                     positions.to(triton_device))
    torch.testing.assert_close(q_dev.cpu(), want_q.to(dtype), **_tol(dtype))
    torch.testing.assert_close(k_dev.cpu(), want_k.to(dtype), **_tol(dtype))
    assert torch.equal(qkv_dev[:, 6].cpu(), qkv[:, 6])     # the V slice is untouched


def test_rope_partial_rotary_leaves_the_tail(triton_device):
    """Tables narrower than the head (rotary_dim < head_dim) rotate only the first dims."""
    rope = _plain(RotaryEmbedding(16, 32, 10000.0))
    x = torch.randn(3, 2, 24)
    positions = torch.tensor([1, 30, 7])
    want, _ = rope(positions, x[..., :16].clone(), x[:, :1, :16].clone())
    got = x.clone().to(triton_device)
    triton_ops.rope_(got, got[:, :1], rope.cos.to(triton_device), rope.sin.to(triton_device),
                     positions.to(triton_device))
    torch.testing.assert_close(got[..., :16].cpu()[:, 1], want[:, 1], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[..., 16:].cpu(), x[..., 16:])


def test_modules_with_the_triton_flag(triton_device):
    """The modules' own Triton branches give what their PyTorch branches give."""
    norm, act = _plain(RMSNorm(40)), _plain(SiluAndMul())
    norm.weight.data.uniform_(0.5, 1.5)
    x, update = torch.randn(2, 3, 40), torch.randn(2, 3, 40)
    want_norm, (want_out, want_sum) = norm(x), norm.add_and_norm(update.clone(), x)
    want_act = act(x.reshape(6, 40))
    norm.to(triton_device)
    norm.triton_kernels = act.triton_kernels = True
    xd, ud = x.to(triton_device), update.to(triton_device)
    torch.testing.assert_close(norm(xd).cpu(), want_norm, rtol=1e-5, atol=1e-5)
    got_out, got_sum = norm.add_and_norm(ud, xd)
    assert got_out.shape == x.shape and got_sum.shape == x.shape
    torch.testing.assert_close(got_out.cpu(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_sum.cpu(), want_sum)
    torch.testing.assert_close(act(xd.reshape(6, 40)).cpu(), want_act, rtol=1e-5, atol=1e-5)
