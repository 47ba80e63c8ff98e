"""GPTQ against round-to-nearest on the objective GPTQ minimises: a layer's output error
tr(dW H dW^T) under the calibration Hessian H."""
import pytest
import torch

from tokenmill.quantization.gptq import HessianAccumulator, gptq, rtn


def _calibration(k: int, rows: int = 2048, seed: int = 0):
    """Rows from one fixed distribution (the same mixing for every seed): correlated inputs
    with a few salient channels, like a transformer's hidden states."""
    mix = torch.Generator().manual_seed(1234)
    basis, salient = torch.randn(16, k, generator=mix), torch.randperm(k, generator=mix)[:4]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 16, generator=g) @ basis + 0.3 * torch.randn(rows, k, generator=g)
    x[:, salient] *= 8.0
    acc = HessianAccumulator(k)
    for chunk in x.split(512):
        acc.add(chunk)
    return x, acc.value()


def _output_error(w, q, h):
    d = w - q.dequantize()
    return torch.einsum("nk,kl,nl->", d, h, d).item()


@pytest.mark.parametrize("act_order,static_groups", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("group_size", [32, 64])
def test_gptq_beats_rtn_on_held_out_inputs(act_order, static_groups, group_size):
    k, n = 256, 64
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.05
    _, h = _calibration(k, seed=0)
    _, h_held_out = _calibration(k, seed=1, rows=4096)   # same distribution, fresh rows
    q = gptq(w, h, 4, group_size, act_order=act_order, static_groups=static_groups)
    base = rtn(w, 4, group_size)
    assert q.q.max() <= 15 and q.q.min() >= 0
    assert _output_error(w, q, h_held_out) < 0.7 * _output_error(w, base, h_held_out)


def test_hessian_accumulator_is_the_mean_outer_product():
    x, h = _calibration(48, rows=1000)
    torch.testing.assert_close(h, 2.0 / x.shape[0] * x.t() @ x, rtol=1e-4, atol=1e-3)


def test_static_groups_keep_contiguous_groups_and_original_grids():
    k, n, g = 128, 16, 32
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(2))
    _, h = _calibration(k)
    q = gptq(w, h, 4, g, act_order=True, static_groups=True)
    assert torch.equal(q.g_idx, torch.arange(k) // g)
    base = rtn(w, 4, g)    # same min/max grid of the untouched weights
    torch.testing.assert_close(q.scale, base.scale)
    torch.testing.assert_close(q.zero, base.zero)
    moved = gptq(w, h, 4, g, act_order=True)
    assert not torch.equal(moved.g_idx, torch.arange(k) // g)   # act-order without static groups permutes
