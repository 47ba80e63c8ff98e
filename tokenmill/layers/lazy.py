"""Checkpoint tensors read on demand: a tensor-parallel rank narrows a lazy tensor to its
piece before anything is read, so no rank materialises a whole weight it splits.

``LazyTensor`` wraps a safetensors slice handle; ``narrow`` only records the range, and
``materialize`` reads that range (floats widened to float32, as eager loading does). Plain
tensors pass through ``materialize`` unchanged, so loaders accept either.
"""
from __future__ import annotations

import torch


class LazyTensor:
    def __init__(self, source, shape: tuple, dtype: torch.dtype, ranges=None) -> None:
        self._source = source            # safetensors PySafeSlice (its file stays open)
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self._ranges = ranges or tuple((0, n) for n in shape)   # per dim: (start, length)

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> "LazyTensor":
        dim = dim % len(self.shape)
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(f"narrow({dim}, {start}, {length}) outside shape {tuple(self.shape)}")
        ranges = list(self._ranges)
        base = ranges[dim][0]
        ranges[dim] = (base + start, length)
        shape = list(self.shape)
        shape[dim] = length
        return LazyTensor(self._source, tuple(shape), self.dtype, tuple(ranges))

    def to(self, dtype: torch.dtype) -> torch.Tensor:
        return materialize(self).to(dtype)

    def materialize(self) -> torch.Tensor:
        index = tuple(slice(s, s + n) for s, n in self._ranges)
        tensor = self._source[index] if index else self._source[:]
        return tensor.to(torch.float32) if tensor.is_floating_point() else tensor


def materialize(t) -> torch.Tensor:
    return t.materialize() if isinstance(t, LazyTensor) else t
