"""Decode of a whole Llama decoder stack in one C call (layers/cpu_decode.c).

Eager PyTorch spends several milliseconds per decode step on Python: ~10 module calls and
~10 kernel calls per layer. When a step is decode-sized (at most ``cpu_ops.LINEAR_MAX_ROWS``
tokens) and the model is a plain Llama stack on the fused CPU kernels (float32 weights
without biases, float32 KV cache, RMSNorm, SiLU, RoPE, no sliding window, no q/k norm, no
hooks), the layers run back to back in C instead: the same kernels in the same order, so
the hidden states are bit-identical to the module path. Anything else returns None and the
caller runs its modules.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tokenmill.layers import cpu_ops


class _StackPlan:
    """Per-model constants of the fused stack: dims and the weight address arrays."""

    def __init__(self, model: nn.Module) -> None:
        layers = model.model.layers
        a0 = layers[0].self_attn
        self.hidden = model.args.hidden_size
        self.heads, self.kv_heads, self.head_dim = a0.num_heads, a0.num_kv_heads, a0.head_dim
        self.inter = layers[0].mlp.down_proj.in_features
        self.eps = float(layers[0].input_layernorm.eps)
        self.scale = float(a0.scale)
        self.rotary = a0.rotary
        self.modules = [m for layer in layers for m in layer.modules()]

        # The C side gets raw addresses: keep the tensors referenced, and check per call
        # that the modules still hold exactly these tensors.
        self.tensors: list[tuple[nn.Module, torch.Tensor]] = []

        def ptrs(get) -> torch.Tensor:
            owners = [get(layer) for layer in layers]
            self.tensors.extend((m, m.weight) for m in owners)
            return torch.tensor([m.weight.data_ptr() for m in owners], dtype=torch.int64)
        self.ln1 = ptrs(lambda l: l.input_layernorm)
        self.wqkv = ptrs(lambda l: l.self_attn.qkv_proj)
        self.wo = ptrs(lambda l: l.self_attn.o_proj)
        self.ln2 = ptrs(lambda l: l.post_attention_layernorm)
        self.wgu = ptrs(lambda l: l.mlp.gate_up_proj)
        self.wd = ptrs(lambda l: l.mlp.down_proj)
        self._caches: list = []

    def usable(self) -> bool:
        """Same weight tensors as when planned, and no hooks that eager mode would run."""
        from torch.nn.modules import module as torch_module
        if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
            return False
        return (all(m.weight is w for m, w in self.tensors)
                and not any(m._forward_hooks or m._forward_pre_hooks for m in self.modules))

    def cache_ptrs(self, kv_caches: list) -> Optional[tuple]:
        if len(kv_caches) != len(self._caches) or any(
                a is not b for pair, old in zip(kv_caches, self._caches) for a, b in zip(pair, old)):
            for k, v in kv_caches:
                if not (_fp32_cpu(k) and _fp32_cpu(v) and k.is_contiguous() and v.is_contiguous()):
                    return None
            self._kc = torch.tensor([k.data_ptr() for k, _ in kv_caches], dtype=torch.int64)
            self._vc = torch.tensor([v.data_ptr() for _, v in kv_caches], dtype=torch.int64)
            self._caches = [tuple(pair) for pair in kv_caches]   # referenced: addresses stay valid
        return self._kc, self._vc


def _fp32_cpu(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype is torch.float32 and t.device.type == "cpu"


def stack_plan(model: nn.Module) -> Optional[_StackPlan]:
    """The model's plan, or None when its stack is not the plain Llama one (cached)."""
    plan = model.__dict__.get("_fused_stack_plan", False)
    if plan is False:
        plan = _StackPlan(model) if _plain_llama_stack(model) else None
        model.__dict__["_fused_stack_plan"] = plan
    return plan


def _plain_llama_stack(model: nn.Module) -> bool:
    from tokenmill.layers.activation import SiluAndMul
    from tokenmill.layers.norm import RMSNorm
    from tokenmill.layers.quant.methods import UnquantizedLinearMethod
    from tokenmill.layers.rotary import RotaryEmbedding
    from tokenmill.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
    layers = list(model.model.layers)
    if not layers:
        return False
    a0, n0 = layers[0].self_attn, layers[0].input_layernorm
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not (type(layer) is LlamaDecoderLayer and type(a) is LlamaAttention and type(m) is LlamaMLP
                and all(type(n) is RMSNorm and n.eps == n0.eps and _fp32_cpu(n.weight) for n in norms)
                and type(m.act) is SiluAndMul and type(a.rotary) is RotaryEmbedding
                and a.rotary is a0.rotary and a.q_norm is None and a.sliding_window is None
                and a.scale == a0.scale and a.head_dim % 2 == 0
                and (a.num_heads, a.num_kv_heads, a.head_dim) == (a0.num_heads, a0.num_kv_heads, a0.head_dim)):
            return False
        for lin in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj):
            w = getattr(lin, "weight", None)
            if (type(lin.quant_method) is not UnquantizedLinearMethod or lin.bias is not None
                    or not _fp32_cpu(w) or not w.is_contiguous()):
                return False
    return _fp32_cpu(a0.rotary.cos) and a0.rotary.cos.is_contiguous() and a0.rotary.sin.is_contiguous()


def run_layers(model: nn.Module, x: torch.Tensor, positions: torch.Tensor, kv_caches: list,
               meta, backend) -> Optional[torch.Tensor]:
    """x [T, hidden] embeddings -> the stack's output (before the final norm), or None when
    the fused path does not apply."""
    t = x.shape[0]
    if not (0 < t <= cpu_ops.LINEAR_MAX_ROWS and getattr(backend, "name", None) == "cpu"
            and cpu_ops.active() and _fp32_cpu(x) and positions.dtype is torch.int64):
        return None
    plan = stack_plan(model)
    if plan is None or len(kv_caches) != len(plan.wqkv) or not plan.usable():
        return None
    caches = plan.cache_ptrs(kv_caches)
    if caches is None:
        return None
    positions = positions.contiguous()
    if int(positions.min()) < 0 or int(positions.max()) >= plan.rotary.cos.shape[0]:
        return None   # the kernel indexes the RoPE tables unchecked
    x = x.contiguous().clone()
    h, hq, hkv, d, i = plan.hidden, plan.heads, plan.kv_heads, plan.head_dim, plan.inter
    scratch = torch.empty(t * (2 * h + (hq + 2 * hkv) * d + hq * d + 3 * i), dtype=torch.float32)
    tables = meta.block_tables.contiguous()
    q_start = meta.query_start_loc[:-1].contiguous()
    q_len = torch.tensor(meta.query_lens, dtype=torch.int64)
    seq_len = meta.seq_lens.contiguous()
    slots = meta.slot_mapping.contiguous()
    kc, vc = caches
    failed = cpu_ops._lib.tm_llama_decode(
        x.data_ptr(), t, h, len(kv_caches), plan.ln1.data_ptr(), plan.wqkv.data_ptr(),
        plan.wo.data_ptr(), plan.ln2.data_ptr(), plan.wgu.data_ptr(), plan.wd.data_ptr(),
        kc.data_ptr(), vc.data_ptr(), hq, hkv, d, i, plan.eps,
        plan.rotary.cos.data_ptr(), plan.rotary.sin.data_ptr(), positions.data_ptr(),
        slots.data_ptr(), kv_caches[0][0].shape[1], tables.data_ptr(), tables.shape[1],
        len(meta.query_lens), q_start.data_ptr(), q_len.data_ptr(), seq_len.data_ptr(),
        plan.scale, scratch.data_ptr(), torch.get_num_threads())
    if failed:
        raise MemoryError("fused decode: the attention kernel could not allocate its buffer")
    return x
