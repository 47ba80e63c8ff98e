"""Checkpoint -> ready model on a device."""
from __future__ import annotations

from typing import Optional

import torch

from tokenmill.distributed.parallel_state import SINGLE, TPGroup
from tokenmill.layers.cpu_ops import set_cpu_kernels
from tokenmill.layers.prepacked import prepack_linears
from tokenmill.layers.quant import (attach_quantization, checkpoint_tensors,
                                    process_weights_after_loading, resolve_quant_spec)
from tokenmill.layers.quant.embedding import share_packed_head_with_embedding
from tokenmill.layers.quant.methods import set_quant_activations
from tokenmill.layers.quant.qgemm import tile_packed_linears
from tokenmill.models.registry import model_class
from tokenmill.models.weights import load_weights


def build_model(checkpoint, device: torch.device, dtype: torch.dtype,
                max_model_len: int, quantization: Optional[str] = None,
                quant_activations: str = "fp32",
                cpu_weight_prepack: bool = False, cpu_kernels: bool = True,
                tp: TPGroup = SINGLE, expert_parallel: bool = False) -> torch.nn.Module:
    """``quantization``: None / "int8" / "int4[-gN]" / "fp8" / "gguf"; a quantized
    checkpoint (GPTQ, AWQ, FP8 config) brings its own scheme. ``quant_activations``: "fp32"
    / "q8" for the packed linears' matmuls. ``cpu_kernels``: the fused C kernels where
    they apply (layers/cpu_ops.py), else plain PyTorch everywhere.
    ``cpu_weight_prepack``: float32 CPU linears get a oneDNN copy of their weight
    (layers/prepacked.py), and packed int8 / int4 linears with q8 activations a tiled copy
    for the tiled q8 GEMM (layers/quant/qgemm.py); ``model.prepacked_bytes`` says what it added.
    ``tp``: this rank's tensor-parallel group; each parameter loads only its piece (safetensors
    are read lazily, slice by slice). ``expert_parallel``: an MoE model's experts are split
    whole over the ranks of ``tp``."""
    cfg = dict(checkpoint.hf_config)
    # RoPE tables only need to cover the context we serve.
    cfg["max_position_embeddings"] = max(max_model_len, 1)
    cls = model_class(cfg)
    with torch.device(device):
        model = cls(cfg, tp, expert_parallel=True) if expert_parallel else cls(cfg, tp)
    spec = resolve_quant_spec(quantization, checkpoint)
    plan = attach_quantization(model, spec)   # strategies create their parameters
    load_weights(model, checkpoint_tensors(checkpoint, spec, plan, lazy=tp.is_parallel))
    model.to(dtype=dtype)
    process_weights_after_loading(model)      # strategies repack what they loaded
    share_packed_head_with_embedding(model)   # tied: no float copy of a packed head
    set_quant_activations(model, quant_activations)
    set_cpu_kernels(model, cpu_kernels)
    model.prepacked_bytes = prepack_linears(model) + tile_packed_linears(model) \
        if cpu_weight_prepack else 0
    model.quantization_method = spec.method   # what runs (a checkpoint's own scheme too)
    model.eval()
    return model
