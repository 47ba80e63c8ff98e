"""load_weights keeps a tensor its reader hands over (``Owned``) as the parameter itself
instead of copying it, where that is the same thing: the whole tensor, same dtype and shape.
Everything else is copied, so a reader's own arrays never become a model's weights."""
import torch
from torch import nn

from tokenmill.layers.lazy import Owned
from tokenmill.layers.linear import Linear, MergedLinear
from tokenmill.models.weights import load_weights


class TwoLinears(nn.Module):
    """A plain linear and a fused q / k one (tests/layers/quant/test_half_weights.py too)."""
    stacked_params = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k")}

    def __init__(self) -> None:
        super().__init__()
        self.proj = Linear(8, 4)
        self.qkv_proj = MergedLinear(8, [4, 2], ["q", "k"])


def _tensors(owned: bool, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    wrap = Owned if owned else (lambda t: t)
    return {name: wrap(torch.randn(shape, generator=g).to(dtype))
            for name, shape in (("proj.weight", (4, 8)), ("q_proj.weight", (4, 8)), ("k_proj.weight", (2, 8)))}


def test_an_owned_whole_tensor_becomes_the_parameter():
    model, tensors = TwoLinears(), _tensors(owned=True)
    load_weights(model, tensors.items())
    given = tensors["proj.weight"].tensor
    assert model.proj.weight.data_ptr() == given.data_ptr()   # kept, not copied
    # fused shards are copied into their rows of the stacked weight
    assert torch.equal(model.qkv_proj.weight[:4], tensors["q_proj.weight"].tensor)
    assert torch.equal(model.qkv_proj.weight[4:], tensors["k_proj.weight"].tensor)
    assert model.qkv_proj.weight.data_ptr() != tensors["q_proj.weight"].tensor.data_ptr()


def test_plain_sliced_or_converted_tensors_are_copied():
    model, tensors = TwoLinears(), _tensors(owned=False)
    load_weights(model, tensors.items())
    assert model.proj.weight.data_ptr() != tensors["proj.weight"].data_ptr()
    assert torch.equal(model.proj.weight, tensors["proj.weight"])

    # owned, but a slice of a bigger storage: keeping it would keep all of that alive
    model, tensors = TwoLinears(), _tensors(owned=True)
    big = torch.randn(8, 8)
    tensors["proj.weight"] = Owned(big[4:])
    load_weights(model, tensors.items())
    assert model.proj.weight.data_ptr() != big[4:].data_ptr()
    assert torch.equal(model.proj.weight, big[4:])

    # owned, another dtype: converted into the parameter's own
    model, tensors = TwoLinears(), _tensors(owned=True, dtype=torch.float64)
    load_weights(model, tensors.items())
    assert model.proj.weight.dtype == torch.float32
    assert torch.equal(model.proj.weight, tensors["proj.weight"].tensor.float())
