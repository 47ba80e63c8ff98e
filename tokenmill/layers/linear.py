"""Linear layers whose parameters know how to load themselves from checkpoint tensors.

``MergedLinear`` fuses several checkpoint projections (q/k/v, gate/up) into one matmul; each
shard is copied into its output range by the parameter's ``weight_loader``.

How the weight is stored and multiplied is a strategy (``layers/quant/methods.py``): plain
float by default, swapped for a quantized one by ``set_quant_method`` before loading. Model
files only construct layers and call them.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from tokenmill.layers.quant.methods import LinearMethod, UnquantizedLinearMethod


def _check_shape(name: str, expected: torch.Size, got: torch.Size) -> None:
    if tuple(expected) != tuple(got):
        raise ValueError(f"tensor {name!r} has shape {tuple(got)}, expected {tuple(expected)}")


class Linear(nn.Module):
    """y = x W^T (+ b). Weight [out_features, in_features] as in HF checkpoints."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32,
                 quant_method: Optional[LinearMethod] = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.params_dtype = dtype
        if not hasattr(self, "shard_sizes"):   # MergedLinear sets its shards first
            self.shard_sizes, self.shard_names = [out_features], [None]
        self._offsets = _offsets(self.shard_sizes, self.shard_names)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
            self.bias.output_dim, self.bias.output_pack = 0, 1
        self.quant_method: Optional[LinearMethod] = None
        self.quant_param_names: list[str] = []
        self.packed = []
        self.set_quant_method(quant_method or UnquantizedLinearMethod())

    def set_quant_method(self, method: LinearMethod) -> None:
        """Swap the weight strategy (before loading): drop the old parameters, create new ones."""
        for name in self.quant_param_names:
            delattr(self, name)
        self.quant_param_names, self.packed = [], []
        self.quant_method = method
        method.create_weights(self)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: Optional[str] = None, name: str = "") -> None:
        """Copy a checkpoint tensor (or one fused shard of it) into ``param``."""
        dim = getattr(param, "output_dim", 0)
        if shard_id is None or dim is None:
            _check_shape(name, param.shape, loaded.shape)
            param.data.copy_(loaded)
            return
        if shard_id not in self._offsets:
            raise ValueError(f"tensor {name!r}: unknown shard {shard_id!r} for this layer")
        start, end = self._offsets[shard_id]
        pack = getattr(param, "output_pack", 1)
        target = param.data.narrow(dim, start // pack, (end - start) // pack)
        _check_shape(name, target.shape, loaded.shape)
        target.copy_(loaded)

    def shard_range(self, shard_id) -> tuple[int, int]:
        return self._offsets[shard_id]

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [T, in] -> [T, out]
        return self.quant_method.apply(self, x, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim."""

    def __init__(self, in_features: int, shard_sizes: Sequence[int], shard_names: Sequence[str],
                 bias: bool = False, dtype: torch.dtype = torch.float32,
                 quant_method: Optional[LinearMethod] = None) -> None:
        self.shard_sizes = list(shard_sizes)
        self.shard_names = list(shard_names)
        super().__init__(in_features, sum(shard_sizes), bias, dtype, quant_method)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:   # [T, sum] -> shards
        return torch.split(out, self.shard_sizes, dim=-1)


def _offsets(sizes: Sequence[int], names: Sequence) -> dict:
    offsets, start = {}, 0
    for size, name in zip(sizes, names):
        offsets[name] = (start, start + size)
        start += size
    return offsets
