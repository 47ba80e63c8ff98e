"""Linear layers whose parameters know how to load themselves from checkpoint tensors.

``MergedLinear`` fuses several checkpoint projections (q/k/v, gate/up) into one matmul; each
shard is copied into its row range by the parameter's ``weight_loader``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn


def _check_shape(name: str, expected: torch.Size, got: torch.Size) -> None:
    if tuple(expected) != tuple(got):
        raise ValueError(f"tensor {name!r} has shape {tuple(got)}, expected {tuple(expected)}")


class Linear(nn.Module):
    """y = x W^T (+ b). Weight [out_features, in_features] as in HF checkpoints."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self._load_full
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self._load_full

    @staticmethod
    def _load_full(param: nn.Parameter, loaded: torch.Tensor, shard_id=None, name: str = "") -> None:
        _check_shape(name, param.shape, loaded.shape)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [T, in] -> [T, out]
        return torch.nn.functional.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim."""

    def __init__(self, in_features: int, shard_sizes: Sequence[int], shard_names: Sequence[str],
                 bias: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(in_features, sum(shard_sizes), bias, dtype)
        self.shard_sizes = list(shard_sizes)
        self.shard_names = list(shard_names)
        offsets = [0]
        for size in shard_sizes:
            offsets.append(offsets[-1] + size)
        self._offsets = {n: (offsets[i], offsets[i + 1]) for i, n in enumerate(shard_names)}
        self.weight.weight_loader = self._load_shard
        if self.bias is not None:
            self.bias.weight_loader = self._load_shard

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor,
                    shard_id: Optional[str] = None, name: str = "") -> None:
        if shard_id is None:
            return self._load_full(param, loaded, name=name)
        start, end = self._offsets[shard_id]
        target = param.data[start:end]
        _check_shape(name, target.shape, loaded.shape)
        target.copy_(loaded)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:   # [T, sum] -> shards
        return torch.split(out, self.shard_sizes, dim=-1)
