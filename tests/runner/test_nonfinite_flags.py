"""Non-finite rows are found in one pass (the C kernel, or one total first); on a GPU the
flags stay on the device until the step's results are read (no extra host sync). The
deferred (tensor) form must flag the same requests as the CPU's immediate list."""
from types import SimpleNamespace

import pytest
import torch

from tokenmill.layers import cpu_ops
from tokenmill.runner.model_runner import (_flag_nonfinite, _flags_list, _nonfinite_rows,
                                           _zero_nonfinite_rows)


def _step(query_lens):
    inp = SimpleNamespace(req_ids=[f"r{i}" for i in range(len(query_lens))],
                          attn_meta=SimpleNamespace(query_lens=query_lens))
    return inp, SimpleNamespace(errors={})


def test_cpu_flags_are_read_at_once():
    x = torch.ones(4, 3)
    assert _nonfinite_rows(x) is None
    x[2, 1] = float("nan")
    assert _nonfinite_rows(x) == [False, False, True, False]
    safe, bad = _zero_nonfinite_rows(x)
    assert bad == [False, False, True, False] and bool((safe[2] == 0).all())
    assert torch.equal(safe[[0, 1, 3]], x[[0, 1, 3]])


def test_device_flags_flag_the_same_requests_as_a_list():
    flags = [False, False, True, False, False, True]
    for bad in (flags, torch.tensor(flags)):           # CPU form, GPU (deferred) form
        inp, out = _step([1, 3, 1, 1])                  # rows 0 | 1-3 | 4 | 5
        out.errors["r3"] = "the model produced non-finite logits (NaN or inf)"
        _flag_nonfinite(bad, inp, out)
        assert set(out.errors) == {"r1", "r3"}
        assert "activations" in out.errors["r1"] and "logits" in out.errors["r3"]
    assert _flags_list(torch.tensor([False, False])) is None
    assert _flags_list(None) is None


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_only_nan_and_inf_values_flag_a_row(kernel, monkeypatch):
    if not kernel:
        monkeypatch.setattr(cpu_ops, "available", lambda: False)
    elif not cpu_ops.available():
        pytest.skip("no kernel library here")
    inf = float("inf")
    x = torch.zeros(3, 4)
    x[0, 1], x[2, 3] = inf, -inf                        # the total is NaN: both rows found
    assert _nonfinite_rows(x) == [True, False, True]
    big = torch.zeros(2, 4)
    big[0, 0] = big[1, 0] = 3e38                        # the total overflows, no row does
    assert _nonfinite_rows(big) is None and _zero_nonfinite_rows(big)[1] is None
    big[1, 1] = 3e38                                    # row 1's own sum overflows: its values are finite
    assert _nonfinite_rows(big) is None
    big[1, 2] = float("nan")
    assert _nonfinite_rows(big) == [False, True]
