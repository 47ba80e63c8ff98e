"""The fused Triton ops (RMSNorm with residual, SiLU / GELU-tanh gates, RoPE) against the
PyTorch modules they stand in for, in fp32, bf16 and fp16 at odd sizes; in Triton's
interpreter where there is no GPU (tests/conftest.py), so shapes stay small."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.layers import triton_ops  # noqa: E402
from tokenmill.layers.activation import GeluTanhAndMul, SiluAndMul  # noqa: E402
from tokenmill.layers.norm import GemmaRMSNorm, RMSNorm  # noqa: E402
from tokenmill.layers.rotary import RotaryEmbedding  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _close(got, want, ulps=1):
    """Within ``ulps`` units in the last place of the output dtype (fp32: rtol 1e-5): the
    kernels compute in fp32 and round once, as the modules do."""
    assert got.dtype == want.dtype and got.shape == want.shape
    rtol = 1e-5 if want.dtype == torch.float32 else ulps * torch.finfo(want.dtype).eps
    torch.testing.assert_close(got.cpu(), want, rtol=rtol, atol=1e-6)


def _plain(module):
    module.cpu_kernels = False
    module.triton_kernels = False
    return module


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


# -- RMSNorm ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("n", [96, 100])
@pytest.mark.parametrize("model_dtype_weight", [False, True])
def test_rms_norm_and_add(triton_device, dtype, norm_cls, n, model_dtype_weight):
    norm = _plain(norm_cls(n, eps=1e-5))
    weight = _randn(n, seed=n, scale=0.5) + (0.0 if norm.gemma else 1.0)
    norm.weight.data = weight.to(dtype) if model_dtype_weight else weight   # else fp32
    x, update = _randn(3, n, dtype=dtype, seed=1), _randn(3, n, dtype=dtype, seed=2)
    want = norm(x)
    want_out, want_sum = norm.add_and_norm(update.clone(), x)
    w, xd, ud = norm.weight.to(triton_device), x.to(triton_device), update.to(triton_device)
    _close(triton_ops.rms_norm(xd, w, 1e-5, gemma=norm.gemma), want)
    got_out, got_sum = triton_ops.rms_norm(ud, w, 1e-5, residual=xd, gemma=norm.gemma)
    _close(got_out, want_out)
    assert torch.equal(got_sum.cpu(), want_sum)   # the residual stream rounds like torch's add
    assert torch.equal(xd.cpu(), x) and torch.equal(ud.cpu(), update)   # inputs untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_of_strided_views(triton_device, dtype):
    norm = _plain(RMSNorm(48))
    norm.weight.data = _randn(48, seed=3)
    wide, wide_res = _randn(4, 96, dtype=dtype, seed=4), _randn(4, 80, dtype=dtype, seed=5)
    view, res_view = wide[:, 8:56], wide_res[:, 32:]   # rows 96 / 80 apart, unit column stride
    w = norm.weight.to(triton_device)
    got = triton_ops.rms_norm(wide.to(triton_device)[:, 8:56], w, 1e-6)
    _close(got, norm(view.contiguous()))
    got_out, got_sum = triton_ops.rms_norm(wide.to(triton_device)[:, 8:56], w, 1e-6,
                                           residual=wide_res.to(triton_device)[:, 32:])
    want_out, want_sum = norm.add_and_norm(view.clone(), res_view.contiguous())
    _close(got_out, want_out)
    assert torch.equal(got_sum.cpu(), want_sum)


def test_rms_norm_no_rows(triton_device):
    w = torch.ones(48, device=triton_device)
    empty = torch.empty(0, 48, dtype=torch.bfloat16, device=triton_device)
    assert triton_ops.rms_norm(empty, w, 1e-6).shape == (0, 48)
    out, total = triton_ops.rms_norm(empty, w, 1e-6, residual=empty, gemma=True)
    assert out.shape == total.shape == (0, 48) and out.dtype == torch.bfloat16


# -- gated activations ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act_cls, op", [(SiluAndMul, triton_ops.silu_mul),
                                         (GeluTanhAndMul, triton_ops.gelu_tanh_mul)])
@pytest.mark.parametrize("inter", [24, 1100])   # 1100: two column blocks, the second partial
def test_gated_activations(triton_device, dtype, act_cls, op, inter):
    x = _randn(3, 2 * inter, dtype=dtype, seed=inter, scale=3.0)
    # bf16 / fp16 modules round act(gate) before multiplying by up: up to 2 ulps apart
    _close(op(x.to(triton_device)), _plain(act_cls())(x), ulps=2)
    assert op(torch.empty(0, 2 * inter, dtype=dtype, device=triton_device)).shape == (0, inter)


@pytest.mark.parametrize("act_cls, op", [(SiluAndMul, triton_ops.silu_mul),
                                         (GeluTanhAndMul, triton_ops.gelu_tanh_mul)])
def test_gated_activation_tails_and_row_view(triton_device, act_cls, op):
    """Large |gate| (exp would overflow) stays finite and matches; rows may be strided."""
    gate = torch.tensor([[-1e4, -100.0, -30.0, -9.0, 0.0, 9.0, 30.0, 100.0, 1e4]])
    wide = torch.cat([gate, torch.full_like(gate, 1.5), torch.ones(1, 5)], dim=1).repeat(2, 1)
    x = wide[:, :18]                                   # rows 23 apart
    got = op(wide.to(triton_device)[:, :18])
    assert torch.isfinite(got).all()
    _close(got, _plain(act_cls())(x.contiguous()))


# -- rotary embedding -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place(triton_device, dtype):
    rope = _plain(RotaryEmbedding(32, 64, 10000.0))
    qkv = _randn(5, 7, 32, dtype=dtype, seed=6)      # q, k as strided views of one buffer
    positions = torch.tensor([0, 3, 63, 17, 5])
    want_q, want_k = rope(positions, qkv[:, :4].clone(), qkv[:, 4:6].clone())
    qkv_dev = qkv.to(triton_device)
    assert triton_ops.rope_(qkv_dev[:, :4], qkv_dev[:, 4:6], rope.cos.to(triton_device),
                            rope.sin.to(triton_device), positions.to(triton_device)) is None
    # the module returns fp32 for half inputs (fp32 tables promote); in place rounds once
    _close(qkv_dev[:, :4], want_q.to(dtype))
    _close(qkv_dev[:, 4:6], want_k.to(dtype))
    assert torch.equal(qkv_dev[:, 6].cpu(), qkv[:, 6])     # the V slice is untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_partial_rotary_leaves_the_tail(triton_device, dtype):
    """Tables narrower than the head (rotary_dim 24 < head_dim 40) rotate only the first
    dims; a rotary half (12) that is not a power of two is masked."""
    rope = _plain(RotaryEmbedding(24, 32, 10000.0))
    q, k = _randn(3, 4, 40, dtype=dtype, seed=7), _randn(3, 2, 40, dtype=dtype, seed=8)
    positions = torch.tensor([1, 30, 7])
    want_q, want_k = rope(positions, q[..., :24].clone(), k[..., :24].clone())
    qd, kd = q.to(triton_device), k.to(triton_device)
    triton_ops.rope_(qd, kd, rope.cos.to(triton_device), rope.sin.to(triton_device),
                     positions.to(triton_device))
    _close(qd[..., :24], want_q.to(dtype))
    _close(kd[..., :24], want_k.to(dtype))
    assert torch.equal(qd[..., 24:].cpu(), q[..., 24:])   # the unrotated tail is untouched
    assert torch.equal(kd[..., 24:].cpu(), k[..., 24:])


def test_rope_no_tokens_and_bad_tables(triton_device):
    rope = RotaryEmbedding(16, 8, 10000.0)
    cos, sin = rope.cos.to(triton_device), rope.sin.to(triton_device)
    q, k = torch.empty(0, 2, 16, device=triton_device), torch.empty(0, 1, 16, device=triton_device)
    triton_ops.rope_(q, k, cos, sin, torch.empty(0, dtype=torch.long, device=triton_device))
    with pytest.raises(ValueError):    # tables wider than the head
        triton_ops.rope_(q[..., :8], k[..., :8], cos, sin, torch.empty(0, dtype=torch.long))


# -- the modules with their Triton flag on ----------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_cls", [RMSNorm, GemmaRMSNorm])
def test_norm_modules_with_the_triton_flag(triton_device, dtype, norm_cls):
    """The modules' own Triton branches give what their PyTorch branches give."""
    norm = _plain(norm_cls(40))
    norm.weight.data.uniform_(-0.5, 0.5) if norm.gemma else norm.weight.data.uniform_(0.5, 1.5)
    x, update = _randn(2, 3, 40, dtype=dtype, seed=9), _randn(2, 3, 40, dtype=dtype, seed=10)
    want_norm, (want_out, want_sum) = norm(x), norm.add_and_norm(update.clone(), x)
    norm.to(triton_device).triton_kernels = True
    xd, ud = x.to(triton_device), update.to(triton_device)
    _close(norm(xd), want_norm)
    got_out, got_sum = norm.add_and_norm(ud, xd)
    _close(got_out, want_out)
    assert torch.equal(got_sum.cpu(), want_sum)


@pytest.mark.parametrize("act_cls", [SiluAndMul, GeluTanhAndMul])
def test_activation_modules_with_the_triton_flag(triton_device, act_cls):
    act, x = _plain(act_cls()), _randn(5, 48, seed=11, scale=2.0)
    want = act(x)
    act.triton_kernels = True
    _close(act(x.to(triton_device)), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_module_with_the_triton_flag(triton_device, dtype):
    rope = _plain(RotaryEmbedding(16, 32, 10000.0, scaling={"rope_type": "linear", "factor": 2.0}))
    q, k = _randn(4, 3, 16, dtype=dtype, seed=12), _randn(4, 1, 16, dtype=dtype, seed=13)
    positions = torch.tensor([31, 0, 2, 2])
    want_q, want_k = rope(positions, q.clone(), k.clone())
    rope.to(triton_device).triton_kernels = True
    qd, kd = q.to(triton_device), k.to(triton_device)
    got_q, got_k = rope(positions.to(triton_device), qd, kd)
    assert got_q is qd and got_k is kd                      # rotated in place
    _close(got_q, want_q.to(dtype))
    _close(got_k, want_k.to(dtype))
