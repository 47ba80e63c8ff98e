"""Checkpoint tensors read on demand: a tensor-parallel rank narrows a lazy tensor to its
piece before anything is read, so no rank materialises a whole weight it splits.

``LazyTensor`` wraps a reader of index ranges (a safetensors slice handle, GGUF rows and
blocks); ``narrow`` only records the range, and ``materialize`` reads that range (floats
widened to float32, as eager loading does). Plain tensors pass through ``materialize``
unchanged, so loaders accept either.

``Owned`` marks the other kind of hand-over: a fresh tensor its reader holds nowhere else.
A loader that says so (``accepts_owned``) may keep it as the parameter's storage instead of
copying it in, so a large weight is never in memory twice while it loads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Owned:
    tensor: torch.Tensor


def adoptable(param: torch.Tensor, loaded: torch.Tensor) -> bool:
    """Whether ``loaded`` can become ``param``'s storage as it is: same dtype, shape and
    device, and the whole of its own storage (not a slice a rank narrowed out of a bigger
    tensor, which would keep all of it alive)."""
    return (loaded.dtype == param.dtype and loaded.shape == param.shape
            and loaded.device == param.device and loaded.is_contiguous()
            and loaded.storage_offset() == 0
            and loaded.untyped_storage().nbytes() == loaded.numel() * loaded.element_size())


def safetensors_reader(handle) -> Callable:
    """ranges -> tensor, for a safetensors PySafeSlice (its file must stay open)."""
    def read(ranges: tuple) -> torch.Tensor:
        index = tuple(slice(s, s + n) for s, n in ranges)
        # a 0-dim tensor has no ranges, and a slice handle refuses [:] on it
        return handle[index] if index else handle[...]
    return read


class LazyTensor:
    def __init__(self, read: Callable, shape: tuple, dtype: torch.dtype, ranges=None) -> None:
        self._read = read                # ((start, length) per dim) -> tensor
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
        return LazyTensor(self._read, tuple(shape), self.dtype, tuple(ranges))

    def to(self, dtype: torch.dtype) -> torch.Tensor:
        return materialize(self).to(dtype)

    def materialize(self) -> torch.Tensor:
        tensor = self._read(self._ranges)
        return tensor.to(torch.float32) if tensor.is_floating_point() else tensor


def materialize(t) -> torch.Tensor:
    if isinstance(t, Owned):
        return t.tensor
    return t.materialize() if isinstance(t, LazyTensor) else t
