"""Linear quantization strategies: how a ``Linear`` creates, post-processes and applies its
weights. Model files never see them; ``attach_quantization`` sets one on each layer.

Protocol (called in this order):
  create_weights(layer)                  register the parameters the checkpoint will fill,
                                         each with ``weight_loader`` and, for fused layers,
                                         ``output_dim`` / ``output_pack`` (how shards stack)
  process_weights_after_loading(layer)   turn loaded tensors into the execution format
  apply(layer, x, bias)                  x [T, in] -> [T, out]
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import cpu_ops, prepacked
from tokenmill.layers.quant import formats
from tokenmill.layers.quant.formats import Packed
from tokenmill.layers.quant.matmul import DEFAULT_KERNEL_MAX_ROWS, packed_linear


def new_param(layer: nn.Module, name: str, tensor: torch.Tensor, output_dim: Optional[int] = 0,
              output_pack: int = 1, input_dim: Optional[int] = None,
              input_pack: int = 1) -> nn.Parameter:
    """Register a frozen parameter that loads through the layer's ``weight_loader``.
    ``output_dim``: the dim fused shards stack along (None: every shard holds the whole
    tensor); ``output_pack``: output rows per stored element along that dim.
    ``input_dim`` / ``input_pack``: the same for input features (a row-parallel layer
    splits along it; None: the tensor does not depend on the input features)."""
    param = nn.Parameter(tensor, requires_grad=False)
    param.output_dim = output_dim
    param.output_pack = output_pack
    param.input_dim = input_dim
    param.input_pack = input_pack
    param.weight_loader = layer.weight_loader
    layer.register_parameter(name, param)
    layer.quant_param_names.append(name)
    return param


def set_packed(layer: nn.Module, parts: list[Packed]) -> None:
    """Replace the layer's quantization parameters by packed parts (outputs concatenate)."""
    for name in layer.quant_param_names:
        delattr(layer, name)
    layer.quant_param_names = []
    for i, part in enumerate(parts):
        # The kernel needs contiguous tensors (unpacked checkpoints often yield transposed
        # views): a non-contiguous part would silently fall back to dequantize-per-call.
        for attr in ("qweight", "scales", "mins"):
            t = getattr(part, attr)
            if t is not None and not t.is_contiguous():
                setattr(part, attr, t.contiguous())
        suffix = "" if len(parts) == 1 else f"_{i}"
        for key, tensor in part.tensors().items():
            new_param(layer, key + suffix, tensor, output_dim=None)
    layer.packed = parts


class LinearMethod:
    """Base strategy: subclasses fill in the three protocol methods."""

    name = "base"

    def create_weights(self, layer: nn.Module) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethod):
    name = "none"
    cpu_kernels = True   # small-M C kernel, prepacked / sliced GEMMs (cpu_ops.set_cpu_kernels)

    def create_weights(self, layer: nn.Module) -> None:
        new_param(layer, "weight", torch.empty(layer.out_features, layer.in_features,
                                               dtype=layer.params_dtype), input_dim=1)

    def apply(self, layer, x, bias):
        if prepacked.tiles_only(layer):   # bf16 mode freed the float32 weight
            y = prepacked.linear(layer, x, bias) if self.cpu_kernels else None
            return y if y is not None else F.linear(x, prepacked.dense_weight(layer), bias)
        if not self.cpu_kernels or x.dim() != 2:
            return F.linear(x, layer.weight, bias)
        if x.shape[0] <= prepacked.float_kernel_rows(layer):   # decode-sized: the C kernel
            y = cpu_ops.linear(x, layer.weight, bias)
            if y is not None:
                return y
        y = prepacked.linear(layer, x, bias)
        if y is not None:
            return y
        return cpu_ops.linear_many_rows(x, layer.weight, bias)


HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FP16_MAX = 65504.0   # largest finite float16


class HalfWeightMethod(LinearMethod):
    """Weights stored in 16 bits (bfloat16 or float16), activations and sums in float32.

    Each checkpoint tensor is rounded to nearest as it loads, into a 16-bit copy (so the
    float32 weights never all exist at once: the float32 parameter load_weights addresses
    stays unwritten), which replaces the parameter after loading. A tied head, loaded
    through the embedding's float table, is rounded then. The C kernels widen each 16-bit
    value exactly and run the float32 kernels' arithmetic
    (cpu_ops.linear_half): decode-sized steps read half the bytes of float32 weights, and
    no second (prepacked) copy is kept, so the weights take a quarter of the float32 path's
    memory. Output bits are those of the float32 model on the rounded weights, at every row
    count. Never bf16 arithmetic (tens of times slower than float32 on AVX2 CPUs)."""

    cpu_kernels = True   # the half-weight C kernels (cpu_ops.set_cpu_kernels)

    def __init__(self, name: str) -> None:
        if name not in HALF_DTYPES:
            raise ValueError(f"16-bit weights are one of {', '.join(HALF_DTYPES)}, got {name!r}")
        self.name, self.dtype = name, HALF_DTYPES[name]
        self.rounded: Optional[nn.Parameter] = None   # the 16-bit copy while loading

    def create_weights(self, layer: nn.Module) -> None:
        UnquantizedLinearMethod().create_weights(layer)
        layer.weight.weight_loader = self._rounding_loader(layer)

    def _rounding_loader(self, layer: nn.Module):
        """The layer's own loader (shards, tensor-parallel pieces) writing into the 16-bit
        copy: copy_ rounds to nearest, as ``.to`` does."""
        def load(param, loaded, shard_id=None, name: str = "") -> None:
            if self.rounded is None:
                self.rounded = nn.Parameter(torch.empty(param.shape, dtype=self.dtype,
                                                        device=param.device), requires_grad=False)
                for attr in ("output_dim", "output_pack", "input_dim", "input_pack"):
                    setattr(self.rounded, attr, getattr(param, attr))
            layer.weight_loader(self.rounded, loaded, shard_id, name)
        load.accepts_lazy = True
        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.rounded is not None:
            w, self.rounded = self.rounded.data, None
        else:   # loaded as float32 (a tied head's embedding table, random weights)
            w = layer.weight.data.to(self.dtype)
        # float16 rounds values past its range to inf
        if self.dtype is torch.float16 and w.numel() and torch.isinf(w).any().item():
            raise ValueError(f"a weight of {layer.out_features} x {layer.in_features} holds values "
                             f"beyond float16's range (+-{FP16_MAX:g}); use quantization='bf16'")
        layer.weight = nn.Parameter(w.contiguous(), requires_grad=False)

    def apply(self, layer, x, bias):
        if self.cpu_kernels and x.dim() == 2:
            y = cpu_ops.linear_half(x, layer.weight, bias)
            if y is not None:
                return y
        return F.linear(x, layer.weight.to(x.dtype), bias)


_activation_changes = [0]   # how many times any packed method's activations were set


def activation_changes() -> int:
    """A counter that moves whenever a packed method's ``activations`` is set: what the fused
    decode plan reads once per step instead of every method's mode."""
    return _activation_changes[0]


class PackedLinearMethod(LinearMethod):
    """Shared execution of packed weights; ``use_kernel=False`` forces the reference path.
    ``activations``: "fp32" / "q8" for this layer's kernel matmuls (set for a whole model
    by ``set_quant_activations``)."""

    _activations: str = "fp32"
    triton_kernels = False   # the Triton GEMM / FP8 tensor cores (CUDA backend; kernel_choice)

    @property
    def activations(self) -> str:
        return self._activations

    @activations.setter
    def activations(self, mode: str) -> None:
        self._activations = mode
        _activation_changes[0] += 1

    def __init__(self, use_kernel: bool = True, kernel_max_rows: int = DEFAULT_KERNEL_MAX_ROWS):
        self.use_kernel = use_kernel
        self.kernel_max_rows = kernel_max_rows

    def apply(self, layer, x, bias):
        parts = layer.packed
        if self.triton_kernels:
            from tokenmill.layers.quant.triton_gemm import triton_packed_linear
            ys = [triton_packed_linear(x, p) for p in parts]
        else:
            ys = [packed_linear(x, p, None, self.use_kernel, self.kernel_max_rows,
                                self.activations) for p in parts]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        if bias is not None:
            y = y + bias
        return y.to(x.dtype)


class OnlineQuantMethod(PackedLinearMethod):
    """Float weights load as usual, then round-to-nearest quantization after loading."""

    def create_weights(self, layer):
        UnquantizedLinearMethod().create_weights(layer)

    def process_weights_after_loading(self, layer):
        set_packed(layer, [self.quantize(layer.weight.data, layer)])

    def quantize(self, w: torch.Tensor, layer: nn.Module) -> Packed:
        raise NotImplementedError


def _whole_row_absmax(w: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """max |w| per output row over all input features: a row-parallel rank holds only some
    of them, so the ranks reduce it and quantize exactly as one process would."""
    absmax = formats.row_absmax(w)
    if getattr(layer, "parallel", None) == "row":
        absmax = layer.tp.all_reduce_max(absmax)
    return absmax


class Int8Method(OnlineQuantMethod):
    """RTN INT8, per-channel symmetric."""
    name = "int8"

    def quantize(self, w, layer):
        return formats.quantize_int8(w, _whole_row_absmax(w, layer))


class Int4Method(OnlineQuantMethod):
    """RTN INT4, group-wise asymmetric (integer zero points, as GPTQ/AWQ store them)."""
    name = "int4"

    def __init__(self, group_size: int = 64, **kw):
        super().__init__(**kw)
        self.group_size = group_size

    def quantize(self, w, layer):
        # The group is chosen for the whole row, so a row-parallel rank groups as one
        # process would (its piece must hold whole groups).
        group = formats.pick_group_size(getattr(layer, "full_in_features", w.shape[1]),
                                        self.group_size)
        if w.shape[1] % group:
            raise ValueError(f"int4 groups of {group} do not fit this rank's {w.shape[1]} input "
                             "features; use a tensor_parallel_size that keeps whole groups")
        return formats.quantize_int4(w, group)


class FP8Method(OnlineQuantMethod):
    """FP8 E4M3 weights with per-channel scales, emulated (expanded in registers) on CPU."""
    name = "fp8"

    def quantize(self, w, layer):
        return formats.quantize_fp8(w, _whole_row_absmax(w, layer))


def set_quant_activations(model: nn.Module, mode: str) -> None:
    """Every packed linear of ``model`` takes ``mode`` ("fp32" / "q8") activations."""
    from tokenmill.layers.quant.matmul import ACTIVATION_MODES
    if mode not in ACTIVATION_MODES:
        raise ValueError(f"quant activations must be one of {ACTIVATION_MODES}, got {mode!r}")
    for m in model.modules():
        if isinstance(getattr(m, "quant_method", None), PackedLinearMethod):
            m.quant_method.activations = mode
