"""Checkpoint -> ready model on a device."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tokenmill.distributed.parallel_state import SINGLE, TPGroup
from tokenmill.layers.cpu_ops import set_cpu_kernels
from tokenmill.layers.kernel_choice import set_triton_kernels
from tokenmill.layers.prepacked import prepack_linears
from tokenmill.layers.quant import (attach_quantization, checkpoint_tensors,
                                    process_weights_after_loading, resolve_quant_spec)
from tokenmill.layers.quant.embedding import (share_half_head_with_embedding,
                                              share_packed_head_with_embedding,
                                              share_tiled_head_with_embedding)
from tokenmill.layers.quant.methods import set_quant_activations
from tokenmill.layers.quant.qgemm import tile_packed_linears
from tokenmill.models.registry import model_class
from tokenmill.models.weights import load_weights, randomize_weights
from tokenmill.utils.heap import keep_freed_heap, release_free_heap
from tokenmill.utils.hugepages import collapse_dense_memory


def build_model(checkpoint, device: torch.device, dtype: torch.dtype,
                max_model_len: int, quantization: Optional[str] = None,
                quant_activations: str = "fp32",
                cpu_weight_prepack: bool = False, cpu_kernels: bool = True,
                cpu_gemm_dtype: torch.dtype = torch.float32,
                tp: TPGroup = SINGLE, expert_parallel: bool = False,
                triton_kernels: bool = False, huge_pages: bool = False) -> torch.nn.Module:
    """``quantization``: None / "int8" / "int4[-gN]" / "fp8" / "gguf"; a quantized
    checkpoint (GPTQ, AWQ, FP8 config) brings its own scheme. ``quant_activations``: "fp32"
    / "q8" for the packed linears' matmuls. ``cpu_kernels``: the fused C kernels where
    they apply (layers/cpu_ops.py), else plain PyTorch everywhere.
    ``cpu_weight_prepack``: float32 CPU linears get a oneDNN copy of their weight
    (layers/prepacked.py), and packed int8 / int4 linears with q8 activations a tiled copy
    for the tiled q8 GEMM (layers/quant/qgemm.py); ``model.prepacked_bytes`` says what it added.
    ``cpu_gemm_dtype``: float32 (the oneDNN copy), or bfloat16 on AVX-512 BF16 CPUs (a tiled bf16
    copy that every matmul of the linear takes; it replaces the float32 weight, and a tied
    embedding reads its rows from the head's tiles).
    ``tp``: this rank's tensor-parallel group; each parameter loads only its piece (safetensors
    are read lazily, slice by slice). ``expert_parallel``: an MoE model's experts are split
    whole over the ranks of ``tp``. ``triton_kernels``: norms, RoPE and gated activations
    run Triton kernels (the Triton backend; kernel_choice.py). ``huge_pages``: once loaded,
    the weights' memory is backed by 2 MB pages where the system allows (utils/hugepages.py)."""
    cfg = dict(checkpoint.hf_config)
    # RoPE tables only need to cover the context we serve.
    cfg["max_position_embeddings"] = max(max_model_len, 1)
    cls = model_class(cfg)
    with torch.device(device):
        model = cls(cfg, tp, expert_parallel=True) if expert_parallel else cls(cfg, tp)
    spec = resolve_quant_spec(quantization, checkpoint)
    plan = attach_quantization(model, spec)   # strategies create their parameters
    if checkpoint.random_weights:
        randomize_weights(model, seed=0)
    else:
        load_weights(model, checkpoint_tensors(checkpoint, spec, plan, lazy=tp.is_parallel))
    model.to(dtype=dtype)
    process_weights_after_loading(model)      # strategies repack what they loaded
    # A GGUF's mapped pages were all touched and the weights are copies: give them back
    # before the prepacked / tiled copies are made, so those do not stack on top of them.
    checkpoint.release_pages()
    share_packed_head_with_embedding(model)   # tied: no float copy of a packed head
    share_half_head_with_embedding(model)     # nor of a 16-bit one
    set_quant_activations(model, quant_activations)
    set_cpu_kernels(model, cpu_kernels and not triton_kernels)
    set_triton_kernels(model, triton_kernels)
    # bf16 mode: the tiles are all a linear's matmuls read, its float32 weight goes (a tied
    # head's too: the embedding then reads its rows from the head's tiles)
    model.prepacked_bytes = _weight_copies(model, cpu_gemm_dtype) \
        if cpu_weight_prepack and not triton_kernels else 0
    if cpu_gemm_dtype is torch.bfloat16:
        share_tiled_head_with_embedding(model)
    model.quantization_method = spec.method   # what runs (a checkpoint's own scheme too)
    model.eval()
    release_free_heap()   # the load's freed temporaries still hold heap pages
    if cpu_gemm_dtype is torch.bfloat16:
        # bf16 mode's layers fault their freed-and-trimmed ~25 MB outputs in again at every
        # 2048-token step (its prompts 7-24 % slower); fp32 and gguf-q8 gain nothing from
        # keeping them and Gemma3 gguf-q8's peak RSS rose ~130 MB (docs/bench/2026-12-07g)
        keep_freed_heap()
    if huge_pages and device.type == "cpu":
        # every decode step streams the weights: 2 MB pages, collapsed in place
        collapse_dense_memory()
    return model


def _weight_copies(module: nn.Module, cpu_gemm_dtype: torch.dtype) -> int:
    """The kernels' weight copies of ``module``'s linears (oneDNN's or bf16 mode's tiles for
    float weights, freeing bf16 mode's float32 ones; tiles for packed q8 ones): the same at
    load and for expert replicas. Returns the bytes added."""
    return prepack_linears(module, cpu_gemm_dtype, free_float=cpu_gemm_dtype is torch.bfloat16) \
        + tile_packed_linears(module)


class _ReplicaHolder(nn.Module):
    """One expert module under a short name, with the model's checkpoint-name mapping, so
    ``load_weights`` can fill it from the checkpoint tensors of that expert alone."""

    def __init__(self, module: nn.Module, stacked_params: dict) -> None:
        super().__init__()
        self.expert = module
        self.stacked_params = stacked_params


def load_expert_replicas(model: nn.Module, checkpoint, plan: list, dtype: torch.dtype,
                         quantization: Optional[str], quant_activations: str, cpu_kernels: bool,
                         cpu_weight_prepack: bool, cpu_gemm_dtype: torch.dtype = torch.float32) -> None:
    """Expert parallel: make MoE layer i hold ``plan[i]`` (expert ids) on this rank too, their
    weights read from ``checkpoint`` and prepared as at load time (quantization, kernels,
    prepacked copies); earlier replicas not in the plan are dropped."""
    from tokenmill.layers.linear import Linear
    from tokenmill.layers.quant import ONLINE_METHODS, method_for
    spec = resolve_quant_spec(quantization, checkpoint)
    if spec.method not in ("none",) + ONLINE_METHODS:
        raise ValueError(f"replicating experts of {spec.method} checkpoints is not supported "
                         "(online int8 / int4 / fp8 and float weights are)")
    if len(plan) != len(model.moe_layers):
        raise ValueError(f"an expert plan lists {len(plan)} layers, the model has {len(model.moe_layers)} MoE layers")
    paths = {id(m): name for name, m in model.named_modules()}
    by_prefix: dict[str, nn.Module] = {}   # checkpoint name prefix of one new replica -> it
    for layer, (moe, experts) in enumerate(zip(model.moe_layers, plan)):
        ckpt_prefix = paths[id(moe)] + ".experts."
        def build(e: int, module: nn.Module, ckpt_prefix=ckpt_prefix) -> None:
            for name, lin in module.named_modules():
                if isinstance(lin, Linear):
                    lin.set_quant_method(method_for(spec, f"{ckpt_prefix}{e}.{name}", lin))
            by_prefix[f"{ckpt_prefix}{e}."] = module
        moe.set_replicas(experts, build)
    if not by_prefix:
        return
    groups: dict[str, list] = {p: [] for p in by_prefix}
    for name, tensor in checkpoint.iter_tensors(lazy=True):
        for prefix in groups:
            if name.startswith(prefix):
                groups[prefix].append(("expert." + name[len(prefix):], tensor))
    added = 0
    for prefix, module in by_prefix.items():
        holder = _ReplicaHolder(module, model.stacked_params)
        load_weights(holder, groups[prefix])
        holder.to(dtype=dtype)
        process_weights_after_loading(holder)
        set_quant_activations(holder, quant_activations)
        set_cpu_kernels(holder, cpu_kernels)
        if cpu_weight_prepack:
            added += _weight_copies(holder, cpu_gemm_dtype)
    model.prepacked_bytes += added
