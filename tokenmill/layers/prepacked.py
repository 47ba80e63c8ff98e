"""Float32 CPU linears with a second copy of the weight in oneDNN's blocked layout, for the
many-row matmuls of prefill and batched decode.

MKL's sgemm packs W into its own panels on every call; oneDNN can take W already reordered
once at load. On this 2-core AVX2 box (Zen 3, 2 threads, GFLOPS, /tmp sweeps) F.linear vs
prepacked: gate_up [3072, 576] at 32 rows 76 vs 117, 64 rows 84 vs 99-101, 512 rows 98 vs
128; the LM head [49152, 576] at 64 rows 60 vs 119. End to end (SmolLM2-135M fp32, 64
ShareGPT prompts, 64 tokens each, same process A/B): 88-93 -> 110-114 tok/s.

The copy costs the float weights' memory once more (``LLM(cpu_weight_prepack=False)`` /
``--no-cpu-weight-prepack`` turns it off). ``cpu_gemm_dtype="bfloat16"`` keeps a tiled bf16
copy instead (half that memory; cpu_ops.linear_bf16, the fused decode stack's kernel too) that
every matmul of the layer takes, decode's few rows too (half the bytes to read): activations
are rounded to bf16, sums and outputs stay float32, and a row's bits do not depend on the
rows beside it. Only CPUs with AVX-512 BF16 multiply bf16 natively, so other CPUs are refused
(bf16 is emulated there, tens of times slower than fp32). A weight whose shape the tiles do
not take (N % 16, odd K) gets oneDNN's bf16 copy for more than BF16_FLOAT_ROWS rows (it rounds
its outputs to bf16) and the float32 kernel below. A layer whose weight tensor is replaced
after packing falls back to F.linear until ``prepack_linears`` runs again.

In bf16 mode the tiles are all a layer's matmuls read, so ``prepack_linears`` frees
the float32 weight of every tiled layer that does not share it (a tied head's goes once
the embedding reads its rows from the head's tiles, quant/embedding.py's TiledEmbedding):
the tiles then hold the layer's values (bf16-rounded), and the paths
that need a plain matrix (autograd, torch.compile, kernels switched off) read it back from
them (``dense_weight``). The model's weights then take 2 bytes a value, not 6.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tokenmill.layers import cpu_ops

PACK_ROWS_HINT = 64      # the row count oneDNN picks its blocked layout for; measured good
#                          from 8 to 512 rows (above)


# bf16 mode (cpu_gemm_dtype) multiplies every row count on the tiled copy: at decode's few
# rows it reads half the float32 weight's bytes (Zen 4, 2 threads, W from memory: 1.9x the
# float32 GEMV at one row, 1.5-1.75x at 16). A weight the tiles do not take has oneDNN's bf16
# copy, for steps of more rows than this; fewer stay float32 on the small-M kernel.
BF16_FLOAT_ROWS = 16


def float_kernel_rows(layer: nn.Module) -> int:
    """The most rows of this layer's matmul that the float32 kernel (cpu_ops.linear) takes;
    more go to the prepacked copy (bf16 mode's tiles: every row)."""
    entry = getattr(layer, "prepacked", None)
    if entry is not None and entry[2] is torch.bfloat16:
        return 0 if bf16_tiles(layer) is not None else BF16_FLOAT_ROWS
    return cpu_ops.LINEAR_MAX_ROWS


def _fresh(layer: nn.Module, entry: tuple) -> bool:
    """Does the prepacked entry still describe the layer's weight? A tiles-only entry
    (address None) does while the layer has no float weight; any other while the layer
    holds the very tensor it was made from."""
    weight = getattr(layer, "weight", None)
    if entry[1] is None:
        return weight is None
    return weight is not None and entry[1] == weight.data_ptr()


def bf16_tiles(layer: nn.Module) -> Optional[torch.Tensor]:
    """The layer's tiled bf16 copy (cpu_ops.bf16_tiles) that every step takes in bf16 mode,
    or None."""
    entry = getattr(layer, "prepacked", None)
    return entry[3] if entry is not None and entry[3] is not None and _fresh(layer, entry) else None


def tiles_only(layer: nn.Module) -> bool:
    """bf16 mode freed the layer's float32 weight: its tiles hold its values."""
    entry = getattr(layer, "prepacked", None)
    return entry is not None and entry[1] is None and bf16_tiles(layer) is not None


def dense_weight(layer: nn.Module) -> Optional[torch.Tensor]:
    """The layer's weight as a plain [N, K] matrix: its own (None if it has none, e.g. a
    packed one), or read back from its tiles (the bf16-rounded values, exactly, in float32)
    when bf16 mode freed it."""
    weight = getattr(layer, "weight", None)
    if weight is not None or not tiles_only(layer):
        return weight
    tiles = bf16_tiles(layer)
    n_tiles, half_k = tiles.shape[0], tiles.shape[1]
    return tiles.permute(0, 2, 1, 3).reshape(n_tiles * 16, half_k * 2).float()


def tiles_only_bytes(model: nn.Module) -> int:
    """Bytes of the bf16 tiles that hold the only copy of their layer's values: weight bytes
    that ``model.parameters()`` no longer shows."""
    return sum(bf16_tiles(m).nbytes for m in model.modules() if tiles_only(m))


def parameter_holders(model: nn.Module) -> dict[int, int]:
    """Data address -> how many parameter slots (over all modules) hold it: 2+ is shared."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                holders[param.data_ptr()] = holders.get(param.data_ptr(), 0) + 1
    return holders


def free_float_weight(module: nn.Module, holders: dict[int, int]) -> None:
    """bf16 mode: free the float32 weight of a linear whose matmuls all take its tiles,
    unless another parameter shares its memory (a tied head's embedding table, which the
    embedding reads)."""
    weight = getattr(module, "weight", None)
    if bf16_tiles(module) is None or not isinstance(weight, torch.Tensor) \
            or holders.get(weight.data_ptr()) != 1:
        return
    _, _, gemm_dtype, tiles = module.prepacked
    del module.weight, weight   # the only references: the memory goes with them
    module.prepacked = (None, None, gemm_dtype, tiles)


def c_kernel_rows(layer: nn.Module) -> int:
    """The most rows of this layer's matmul that a C kernel takes (the float32 one, then in
    bf16 mode the tiled bf16 one): what the fused decode stack can run for it."""
    return cpu_ops.LINEAR_MAX_ROWS if bf16_tiles(layer) is not None else float_kernel_rows(layer)


def available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def check_gemm_dtype(gemm_dtype: torch.dtype) -> None:
    """bf16 copies only where the CPU multiplies bf16 natively (a clear error elsewhere)."""
    from tokenmill.layers import native
    if gemm_dtype is torch.bfloat16 and not native.has_avx512_bf16():
        raise ValueError("cpu_gemm_dtype='bfloat16' needs a CPU with AVX-512 BF16 (Zen 4 / "
                         "Sapphire Rapids or newer); this one would emulate bf16 far slower "
                         "than float32")
    if gemm_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the oneDNN weight copy is float32 or bfloat16, not {gemm_dtype}")


def prepack_linears(model: nn.Module, gemm_dtype: torch.dtype = torch.float32,
                    free_float: bool = False) -> int:
    """Give every float32 CPU ``Linear`` with a plain weight its oneDNN copy in
    ``gemm_dtype`` (float32 or bfloat16); returns the bytes added (0 when oneDNN is
    missing). A tied head shares its tensor with the embedding, so the head is packed like
    any other weight. ``free_float`` (bf16 mode): a layer's float32 weight is freed as soon
    as its tiles exist (not shared, see free_float_weight), so the load never holds both
    copies of the whole model."""
    check_gemm_dtype(gemm_dtype)
    from tokenmill.layers.linear import Linear
    from tokenmill.layers.quant.methods import UnquantizedLinearMethod
    if not available():
        return 0
    added = 0
    holders = parameter_holders(model) if free_float else {}
    for module in list(model.modules()):
        weight = getattr(module, "weight", None)
        if not (isinstance(module, Linear) and isinstance(module.quant_method, UnquantizedLinearMethod)
                and isinstance(weight, torch.Tensor) and weight.dtype is torch.float32
                and weight.device.type == "cpu" and weight.dim() == 2):
            continue
        tiles = cpu_ops.bf16_tiles(weight) if gemm_dtype is torch.bfloat16 else None
        packed = None if tiles is not None else torch.ops.mkldnn._reorder_linear_weight(
            weight.detach().contiguous().to(gemm_dtype), PACK_ROWS_HINT)
        module.prepacked = (packed, weight.data_ptr(), gemm_dtype, tiles)
        added += tiles.numel() * 2 if tiles is not None else weight.numel() * gemm_dtype.itemsize
        del weight
        if free_float:
            free_float_weight(module, holders)
    return added


def linear(layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """x [M, K] @ W^T (+ b) through the layer's prepacked weight; None when it has none, it
    is stale, the CPU fast paths are off, torch.compile is tracing, or autograd records the
    call (oneDNN's op has no backward: the gradient would stop there without an error)."""
    entry = getattr(layer, "prepacked", None)
    if (entry is None or not _fresh(layer, entry) or cpu_ops.tracing()
            or (x.requires_grad and torch.is_grad_enabled())
            or x.dim() != 2 or x.dtype is not torch.float32 or x.is_cuda
            or (bias is not None and bias.dtype is not torch.float32)):
        return None
    packed, _, gemm_dtype, tiles = entry
    if tiles is not None:   # bf16 mode: the C stack's kernel, at any row count
        return cpu_ops.linear_bf16(x.contiguous(), tiles, bias)
    if gemm_dtype is torch.float32:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    y = torch.ops.mkldnn._linear_pointwise(x.to(gemm_dtype).contiguous(), packed, None, "none", [], "")
    y = y.float()   # bf16-rounded sums of fp32 accumulation; the bias is added in fp32
    return y if bias is None else y.add_(bias)
