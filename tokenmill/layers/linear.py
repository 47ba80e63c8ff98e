"""Linear layers whose parameters know how to load themselves from checkpoint tensors.

``MergedLinear`` fuses several checkpoint projections (q/k/v, gate/up) into one matmul; each
shard is copied into its output range by the parameter's ``weight_loader``.

How the weight is stored and multiplied is a strategy (``layers/quant/methods.py``): plain
float by default, swapped for a quantized one by ``set_quant_method`` before loading. Model
files only construct layers and call them.

Tensor parallelism (Megatron style), given a ``TPGroup``:
- ``parallel="column"``: each rank holds a slice of the output features (of every fused
  shard); ``gather_output`` concatenates the ranks' outputs (the vocab-parallel LM head);
- ``parallel="row"``: each rank holds a slice of the input features; the partial outputs
  are summed by one all-reduce, then the bias is added once (``reduce_output=False``: the
  caller sums several partial outputs first and reduces once, as MoE experts do);
- ``shard_parts``: a fused shard split into fewer parts than ranks (KV heads replicated
  when ``tp > num_kv_heads``): name -> (number of parts, this rank's part).
Parameter sizes are this rank's; ``weight_loader`` cuts the rank's piece out of the full
checkpoint tensor (``output_dim`` / ``output_pack``, ``input_dim`` / ``input_pack`` say how
the stored tensor maps to features, so packed quant formats split the same way).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from tokenmill.distributed.parallel_state import SINGLE, TPGroup, split_evenly
from tokenmill.layers import weight_swaps
from tokenmill.layers.quant.methods import LinearMethod, UnquantizedLinearMethod
from tokenmill.layers.lazy import adoptable, materialize


def _check_shape(name: str, expected: torch.Size, got: torch.Size) -> None:
    if tuple(expected) != tuple(got):
        raise ValueError(f"tensor {name!r} has shape {tuple(got)}, expected {tuple(expected)}")


_WEIGHT_ATTRIBUTES = frozenset({"packed", "prepacked"})   # what weight_swaps counts here


class Linear(nn.Module):
    """y = x W^T (+ b). Weight [out_features, in_features] as in HF checkpoints."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32,
                 quant_method: Optional[LinearMethod] = None, *, tp: TPGroup = SINGLE,
                 parallel: Optional[str] = None, gather_output: bool = False,
                 shard_parts: Optional[dict] = None, reduce_output: bool = True) -> None:
        super().__init__()
        if parallel not in (None, "column", "row"):
            raise ValueError(f"parallel must be None, 'column' or 'row', got {parallel!r}")
        if bias and parallel == "row" and not reduce_output:
            raise ValueError("a row-parallel layer that leaves the reduction to its caller "
                             "cannot add its bias (every rank would add it)")
        self.tp, self.parallel, self.gather_output = tp, parallel, gather_output
        self.reduce_output = reduce_output
        self.full_in_features, self.full_out_features = in_features, out_features
        if not hasattr(self, "shard_sizes"):   # MergedLinear sets its shards first
            self.shard_sizes, self.shard_names = [out_features], [None]
        # Per shard: (first row in the checkpoint tensor, rows this rank holds).
        self.checkpoint_rows = _rank_rows(self.shard_sizes, self.shard_names, tp, parallel,
                                          shard_parts or {}, pad=gather_output)
        self.shard_sizes = [self.checkpoint_rows[n][1] for n in self.shard_names]
        if parallel == "row":
            in_features = split_evenly(in_features, tp.size, "input features of a linear layer")
        self.in_features = in_features
        self.out_features = sum(self.shard_sizes)
        self.params_dtype = dtype
        self._offsets = _offsets(self.shard_sizes, self.shard_names)
        out_features = self.out_features
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
            self.bias.output_dim, self.bias.output_pack = 0, 1
        self.quant_method: Optional[LinearMethod] = None
        self.quant_param_names: list[str] = []
        self.packed = []
        self.set_quant_method(quant_method or UnquantizedLinearMethod())

    def __setattr__(self, name: str, value) -> None:
        if name in _WEIGHT_ATTRIBUTES:   # plain attributes: torch's registration hooks miss them
            weight_swaps.bump()
        super().__setattr__(name, value)

    def set_quant_method(self, method: LinearMethod) -> None:
        """Swap the weight strategy (before loading): drop the old parameters, create new ones."""
        for name in self.quant_param_names:
            delattr(self, name)
        self.quant_param_names, self.packed = [], []
        self.quant_method = method
        method.create_weights(self)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: Optional[str] = None, name: str = "", owned: bool = False) -> None:
        """Copy a checkpoint tensor (or one fused shard of it) into ``param``: this rank's
        piece of it when the layer is split. A whole tensor the reader hands over
        (``owned``) becomes the parameter's storage instead."""
        loaded = self.rank_piece(param, loaded, shard_id, name)
        dim = getattr(param, "output_dim", 0)
        if shard_id is None or dim is None:
            _check_shape(name, param.shape, loaded.shape)
            if owned and adoptable(param.data, loaded):
                param.data = loaded
            else:
                param.data.copy_(loaded)
            return
        if shard_id not in self._offsets:
            raise ValueError(f"tensor {name!r}: unknown shard {shard_id!r} for this layer")
        start, end = self._offsets[shard_id]
        pack = getattr(param, "output_pack", 1)
        target = param.data.narrow(dim, start // pack, (end - start) // pack)
        _check_shape(name, target.shape, loaded.shape)
        target.copy_(loaded)

    def rank_piece(self, param: nn.Parameter, loaded, shard_id, name: str) -> torch.Tensor:
        """The part of a full checkpoint tensor (or lazy slice of one) this rank stores."""
        out_dim, in_dim = getattr(param, "output_dim", 0), getattr(param, "input_dim", None)
        if self.parallel == "column" and out_dim is not None and self.tp.is_parallel:
            if shard_id is None and len(self.shard_names) > 1:
                raise ValueError(f"tensor {name!r}: a split fused layer loads shard by shard")
            start, rows = self.checkpoint_rows[shard_id]
            pack = getattr(param, "output_pack", 1)
            loaded = _narrow_padded(loaded, out_dim, start // pack, rows // pack)
        elif self.parallel == "row" and in_dim is not None and self.tp.is_parallel:
            pack = getattr(param, "input_pack", 1)
            if self.in_features % pack:
                raise ValueError(
                    f"tensor {name!r}: splitting {self.full_in_features} input features over "
                    f"{self.tp.size} ranks ({self.in_features} each) would cut its quantization "
                    f"groups of {pack}; use a tensor_parallel_size that keeps whole groups")
            loaded = loaded.narrow(in_dim, self.tp.rank * self.in_features // pack,
                                   self.in_features // pack)
        return materialize(loaded)

    weight_loader.accepts_lazy = True   # it narrows before reading (models/weights.py)
    weight_loader.accepts_owned = True

    def shard_range(self, shard_id) -> tuple[int, int]:
        return self._offsets[shard_id]

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [T, in] -> [T, out]
        if self.parallel == "row" and self.tp.is_parallel:
            y = self.quant_method.apply(self, x, None)
            if not self.reduce_output:
                return y
            y = self.tp.all_reduce(y)
            return y if self.bias is None else y + self.bias
        y = self.quant_method.apply(self, x, self.bias)
        if self.gather_output and self.tp.is_parallel:
            y = self.tp.all_gather(y, dim=-1)[..., :self.full_out_features]
        return y


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim."""

    def __init__(self, in_features: int, shard_sizes: Sequence[int], shard_names: Sequence[str],
                 bias: bool = False, dtype: torch.dtype = torch.float32,
                 quant_method: Optional[LinearMethod] = None, *, tp: TPGroup = SINGLE,
                 parallel: Optional[str] = None, shard_parts: Optional[dict] = None) -> None:
        self.shard_sizes = list(shard_sizes)   # full sizes; this rank's after __init__
        self.shard_names = list(shard_names)
        super().__init__(in_features, sum(shard_sizes), bias, dtype, quant_method, tp=tp,
                         parallel=parallel, shard_parts=shard_parts)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:   # [T, sum] -> shards
        return torch.split(out, self.shard_sizes, dim=-1)


def _rank_rows(sizes: Sequence[int], names: Sequence, tp: TPGroup, parallel: Optional[str],
               parts: dict, pad: bool) -> dict:
    """name -> (first checkpoint row, rows) this rank holds of each output shard. ``pad``:
    an uneven split rounds up (the last rank's missing rows load as zeros)."""
    rows = {}
    for size, name in zip(sizes, names):
        if parallel != "column" or tp.size == 1:
            rows[name] = (0, size)
            continue
        num_parts, index = parts.get(name, (tp.size, tp.rank))
        local = -(-size // num_parts) if pad else split_evenly(size, num_parts,
                                                               "output features of a linear layer")
        rows[name] = (index * local, local)
    return rows


def _narrow_padded(t, dim: int, start: int, length: int):
    """``t.narrow(dim, start, length)``, zero-filled where the range runs past the end."""
    available = max(0, min(length, t.shape[dim] - start))
    if available == length:
        return t.narrow(dim, start, length)
    piece = materialize(t.narrow(dim, start, available)) if available else None
    shape = list(t.shape)
    shape[dim] = length - available
    fill = torch.zeros(shape, dtype=piece.dtype if piece is not None else t.dtype)
    return fill if piece is None else torch.cat([piece, fill], dim=dim)


def _offsets(sizes: Sequence[int], names: Sequence) -> dict:
    offsets, start = {}, 0
    for size, name in zip(sizes, names):
        offsets[name] = (start, start + size)
        start += size
    return offsets
