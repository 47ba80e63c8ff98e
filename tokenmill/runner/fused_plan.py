"""The plan of the one-call C decode stack (runner/fused_stack.py, layers/cpu_decode.c): for
each layer a row of int64 fields saying what it has (layers/cpu_decode.c's ``LD_*``: norm
weights and style, sandwich norms, per-head q/k norms, biases, activation, sliding window,
RoPE tables, eps, attention scale), and the descriptors of its linears. A layer is planned
only when the C loop computes exactly what its modules would; anything else makes the
whole model None, and the runner keeps running its modules.

Decoders the C loop replicates: ``LlamaDecoderLayer`` (Llama, Mistral, Qwen2, Qwen3) and
``Gemma3DecoderLayer`` (four norms: input, post-attention, pre- and post-feedforward);
MoE layers (every layer's FFN a ``SparseMoE``) have their attention half planned.
"""
from __future__ import annotations

import operator
import struct
from typing import Optional

import torch
from torch import nn
from torch.utils import hooks as torch_hooks

from tokenmill.layers import cpu_ops, prepacked, weight_swaps
from tokenmill.layers.quant import methods
from tokenmill.layers.activation import GeluTanhAndMul, SiluAndMul
from tokenmill.layers.moe import SparseMoE
from tokenmill.layers.norm import GemmaRMSNorm, RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.gemma3 import Gemma3Attention, Gemma3DecoderLayer
from tokenmill.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from tokenmill.models.mixtral import MixtralDecoderLayer

DEC_PARTS, DEC_FIELDS = 4, 11   # cpu_decode_linear.c: parts per linear, int64 fields per part
_NO_PART = [-2] + [0] * (DEC_FIELDS - 1)
# cpu_decode.c's LD_* enum, in order (tests/models/test_fused_architectures.py compares them)
LAYER_FIELDS = ("linears", "norm_in", "norm_post_attn", "norm_pre_ffn", "norm_post_ffn",
                "q_norm", "k_norm", "bias_qkv", "bias_o", "bias_gate_up", "bias_down",
                "gemma", "act", "window", "cos", "sin", "eps", "scale")
ACT_CODES = {SiluAndMul: 0, GeluTanhAndMul: 1}   # cpu_decode.c: LD_ACT


def is_fp32_cpu(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype is torch.float32 and t.device.type == "cpu"


def _vector_ok(t, n: int) -> bool:
    """A float32 CPU [n] tensor the C side can read by address."""
    return is_fp32_cpu(t) and t.is_contiguous() and t.shape == (n,)


def _float_bits(value: float) -> int:
    """value rounded to float32 (as ctypes passes a float argument), as its bit pattern."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def _layer_norms(layer: nn.Module) -> Optional[tuple]:
    """(input, post-attention, pre-FFN, post-FFN) norms of a decoder whose forward the C loop
    replicates (the last two None for the Llama shape), else None."""
    if type(layer) in (LlamaDecoderLayer, MixtralDecoderLayer):
        return layer.input_layernorm, layer.post_attention_layernorm, None, None
    if type(layer) is Gemma3DecoderLayer:
        return (layer.input_layernorm, layer.post_attention_layernorm,
                layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm)
    return None


def _norms_ok(layer_norms: list, head_norms: list, hidden: int, head_dim: int) -> bool:
    """One kind (RMSNorm or GemmaRMSNorm: the layer's LD_GEMMA) and one eps for all the
    layer's norms, its per-head q / k norms (both or none) included."""
    kind, eps = type(layer_norms[0]), layer_norms[0].eps
    sized = [(n, hidden) for n in layer_norms] + [(n, head_dim) for n in head_norms]
    return kind in (RMSNorm, GemmaRMSNorm) and len(head_norms) in (0, 2) and all(
        type(n) is kind and n.eps == eps and _vector_ok(n.weight, size) for n, size in sized)


def _attention_ok(a: nn.Module, a0: nn.Module) -> bool:
    rotary = a.rotary
    return (type(a) in (LlamaAttention, Gemma3Attention) and not a.norm_over_projection
            and a.clip_qkv is None and a.head_dim % 2 == 0
            and (a.num_heads, a.num_kv_heads, a.head_dim) == (a0.num_heads, a0.num_kv_heads, a0.head_dim)
            and type(rotary) is RotaryEmbedding and is_fp32_cpu(rotary.cos)
            and rotary.cos.is_contiguous() and rotary.sin.is_contiguous())


def stack_kind(model: nn.Module) -> Optional[str]:
    """"dense" (whole layers in C), "moe" (attention in C, experts as modules) or None."""
    if getattr(model, "tp", None) is not None and model.tp.size != 1:
        return None   # split layers need their all-reduces
    layers = list(model.model.layers)
    if not layers or any(_layer_norms(layer) is None for layer in layers):
        return None
    ffns = [layer._modules.get(getattr(layer, "ffn_name", "mlp")) for layer in layers]
    moe = all(type(f) is SparseMoE for f in ffns)
    a0 = layers[0].self_attn
    for layer, ffn in zip(layers, ffns):
        a = layer.self_attn
        norms = [n for n in _layer_norms(layer) if n is not None]
        head_norms = [n for n in (a.q_norm, a.k_norm) if n is not None]
        dense_ok = (type(ffn) is LlamaMLP and type(ffn.act) in ACT_CODES
                    and ffn.down_proj.in_features == ffns[0].down_proj.in_features)
        if not ((moe or dense_ok) and _attention_ok(a, a0)
                and _norms_ok(norms, head_norms, model.args.hidden_size, a.head_dim)):
            return None
    return "moe" if moe else "dense"


def _linear_desc(lin: nn.Module) -> Optional[tuple[list[int], object]]:
    """cpu_decode_linear.c's descriptor of one linear and the object whose identity pins it
    (the float weight, or the packed-parts list), or None when the C path cannot run it
    exactly as the module would. Its bias (if any) is the layer row's business."""
    from tokenmill.layers.quant import kernels
    from tokenmill.layers.quant.matmul import _KINDS, kernel_applies
    from tokenmill.layers.quant.methods import (HalfWeightMethod, PackedLinearMethod,
                                                UnquantizedLinearMethod)
    method = lin.quant_method
    if lin.bias is not None and not _vector_ok(lin.bias, lin.out_features):
        return None
    if type(method) is UnquantizedLinearMethod:
        tiles = prepacked.bf16_tiles(lin)   # bf16 mode: field 7 = its tiles, which every step takes
        bf16 = [0, tiles.data_ptr()] if tiles is not None else []
        if prepacked.tiles_only(lin):   # no float32 weight left (pinned: still none)
            return _one_part([-1, 0, 0, 0, 0, tiles.shape[0] * 16] + bf16), None
        w = getattr(lin, "weight", None)
        if not (is_fp32_cpu(w) and w.is_contiguous()):
            return None
        return _one_part([-1, w.data_ptr(), 0, 0, 0, w.shape[0]] + bf16), w
    if type(method) is HalfWeightMethod:   # 16-bit weight: kind -3, its value type in field 2
        w = getattr(lin, "weight", None)
        if not (isinstance(w, torch.Tensor) and w.dtype in cpu_ops.HALF_WEIGHT_CODES
                and w.device.type == "cpu" and w.is_contiguous() and method.cpu_kernels):
            return None
        return _one_part([-3, w.data_ptr(), cpu_ops.HALF_WEIGHT_CODES[w.dtype], 0, 0, w.shape[0]]), w
    if not (isinstance(method, PackedLinearMethod) and type(method).apply is PackedLinearMethod.apply
            and method.use_kernel):
        return None
    parts = lin.packed
    if not parts or len(parts) > DEC_PARTS or not all(kernel_applies(p) for p in parts):
        return None
    desc = []
    for p in parts:
        if p.perm is not None and not (p.perm.dtype is torch.int64 and p.perm.is_contiguous()
                                       and p.perm.numel() == p.in_features):
            return None
        values = p.qweight.data_ptr() if p.qweight is not None else 0   # 0: only tiled (q8 steps)
        desc += [kernels.kind_code(_KINDS[p.kind], p.scales), values, p.scales.data_ptr(),
                 p.mins.data_ptr() if p.mins is not None else 0, p.group_size, p.out_features,
                 p.perm.data_ptr() if p.perm is not None else 0] + _tiled_fields(p)
    return desc + _NO_PART * (DEC_PARTS - len(parts)), parts


def _one_part(fields: list[int]) -> list[int]:
    """A descriptor of one part (its first fields, the rest zero) and no others."""
    return fields + [0] * (DEC_FIELDS - len(fields)) + _NO_PART * (DEC_PARTS - 1)


def _tiled_fields(p) -> list[int]:
    """The tiled copy's addresses (qw, sc, mn or 0) and kind for q8 steps, zeros without one."""
    t = p.tiled
    if t is None:
        return [0, 0, 0, 0]
    return [t.qw.data_ptr(), t.sc.data_ptr(), t.mn.data_ptr() if t.mn is not None else 0, t.kind]


def stack_plan(model: nn.Module) -> Optional["StackPlan"]:
    """The model's plan, or None when the C loop cannot run its stack (cached)."""
    plan = model.__dict__.get("_fused_stack_plan", False)
    if plan is False:
        kind = stack_kind(model)
        plan = _build(model, kind) if kind is not None else None
        model.__dict__["_fused_stack_plan"] = plan
    return plan


def _build(model: nn.Module, kind: str) -> Optional["StackPlan"]:
    """The plan, or None when a linear is one the C path cannot run."""
    layer_linears = []
    for layer in model.model.layers:
        a = layer.self_attn
        lins = [a.qkv_proj, a.o_proj] + ([] if kind == "moe" else [layer.mlp.gate_up_proj, layer.mlp.down_proj])
        descs = [_linear_desc(lin) for lin in lins]
        if any(d is None for d in descs):
            return None
        layer_linears.append([(lin, *d) for lin, d in zip(lins, descs)])
    return StackPlan(model, kind, layer_linears)


class StackPlan:
    """Per-model constants of the fused stack: dims, the layer rows (``layers`` [L,
    len(LAYER_FIELDS)] int64) and the linear descriptors they point into (``linears``: per
    layer qkv, o, gate_up, down; MoE layers' last two empty)."""

    def __init__(self, model: nn.Module, kind: str, layer_linears: list) -> None:
        layers = model.model.layers
        a0 = layers[0].self_attn
        self.hidden = model.args.hidden_size
        self.heads, self.kv_heads, self.head_dim = a0.num_heads, a0.num_kv_heads, a0.head_dim
        # MoE: each layer's SparseMoE, run between the C calls
        self.moe_ffns = [layer._modules[layer.ffn_name] for layer in layers] if kind == "moe" else None
        self.inter = 0 if self.moe_ffns else layers[0].mlp.down_proj.in_features
        self.num_layers = len(layers)
        self.windows = tuple(layer.self_attn.sliding_window for layer in layers)   # their KV group
        self.rotaries = list({id(layer.self_attn.rotary): layer.self_attn.rotary for layer in layers}.values())
        # each module's hook dicts (registering a hook fills them; they are not replaced)
        self.hook_dicts = [d for layer in layers for m in layer.modules()
                           for d in (m._forward_hooks, m._forward_pre_hooks)]
        self._no_hooks_at = -1   # RemovableHandle.next_id when a scan last found no hook
        rows = []
        for lins in layer_linears:   # 4 slots per layer (MoE: qkv and o, then 2 empty)
            rows += [v for _, desc, _ in lins for v in desc] + _NO_PART * DEC_PARTS * (4 - len(lins))
        self.linears = torch.tensor(rows, dtype=torch.int64)
        # The C side gets raw addresses: keep what they point into referenced, and check per
        # call that the modules still hold exactly these objects: (where the module keeps
        # it, its name, the object planned). Packed parts live in the module's __dict__.
        self.pins = [(lin.__dict__, "packed", pin) if isinstance(pin, list) else (lin._parameters, "weight", pin)
                     for lins in layer_linears for lin, _, pin in lins]
        self.layers = torch.tensor([self._layer_row(i, layer, [lin for lin, _, _ in lins])
                                    for i, (layer, lins) in enumerate(zip(layers, layer_linears))],
                                   dtype=torch.int64)
        self._caches: list = []
        self.packed_methods = list({id(lin.quant_method): lin.quant_method
                                    for lins in layer_linears for lin, _, pin in lins
                                    if isinstance(pin, list)}.values())
        # parts whose values live only in their tiled copy: the C loop reads them at q8 steps only
        parts = [p for lins in layer_linears for _, _, pin in lins if isinstance(pin, list) for p in pin]
        self.tiled_only = any(p.qweight is None for p in parts)
        self._activations_at = -1   # methods.activation_changes() when activations() last read them
        # bf16 mode's tiled copies are pinned too: they live in the module's prepacked entry
        self.pins += [(lin.__dict__, "prepacked", lin.__dict__["prepacked"])
                      for lins in layer_linears for lin, _, pin in lins
                      if not isinstance(pin, list) and prepacked.bf16_tiles(lin) is not None]
        self.float_rows = min([prepacked.c_kernel_rows(lin) for lins in layer_linears
                               for lin, _, pin in lins if not isinstance(pin, list)],
                              default=cpu_ops.LINEAR_MAX_ROWS)
        # q8 steps take every part's tiled copy (tm_qgemm_q8: any row count)
        self.all_tiled = all(p.tiled is not None for p in parts)
        # the pins as columns (stores, names, objects), compared in one pass per step
        self._pin_columns = tuple(zip(*self.pins)) or ((), (), ())
        self._pins_seen_at = -1   # weight_swaps.count() when a scan last found every pin held

    def _pin(self, store: dict, name: str) -> int:
        """The address of store[name], which usable() checks is still the module's."""
        self.pins.append((store, name, store[name]))
        return store[name].data_ptr()

    def _layer_row(self, index: int, layer: nn.Module, lins: list) -> list[int]:
        """cpu_decode.c's LD_* fields of one layer."""
        a = layer.self_attn
        norms = _layer_norms(layer)
        row = dict.fromkeys(LAYER_FIELDS, 0)
        row["linears"] = self.linears.data_ptr() + 8 * index * 4 * DEC_PARTS * DEC_FIELDS
        for field, norm in zip(("norm_in", "norm_post_attn", "norm_pre_ffn", "norm_post_ffn", "q_norm", "k_norm"),
                               norms + (a.q_norm, a.k_norm)):
            if norm is not None:
                row[field] = self._pin(norm._parameters, "weight")
        for field, lin in zip(("bias_qkv", "bias_o", "bias_gate_up", "bias_down"), lins):
            if lin.bias is not None:
                row[field] = self._pin(lin._parameters, "bias")
        row["gemma"] = int(norms[0].gemma)
        row["act"] = 0 if self.moe_ffns else ACT_CODES[type(layer.mlp.act)]
        row["window"] = a.sliding_window or 0
        row["cos"], row["sin"] = self._pin(a.rotary._buffers, "cos"), self._pin(a.rotary._buffers, "sin")
        row["eps"], row["scale"] = _float_bits(norms[0].eps), _float_bits(a.scale)
        return [row[f] for f in LAYER_FIELDS]

    def activations(self) -> Optional[str]:
        """"q8" / "fp32": what every packed linear takes now ("fp32" without packed
        linears); None if they differ, or if the C loop would need values only tiled.
        Read again only after a method's mode was set (methods.activation_changes)."""
        changes = methods.activation_changes()
        if self._activations_at != changes:
            modes = {m.activations for m in self.packed_methods}
            mode = modes.pop() if len(modes) == 1 else ("fp32" if not modes else None)
            self._activations = None if self.tiled_only and mode != "q8" else mode
            self._activations_at = changes
        return self._activations

    def max_rows(self, activations: str) -> int:
        """The most rows a step may have here: as many as the float kernel takes for every
        float linear (prepacked.float_kernel_rows), and no more than a packed method's
        streaming kernel takes where a part streams (float activations, or q8 over a part
        without a tiled copy): past that the modules multiply a dequantized copy, with other
        bits."""
        if activations == "q8" and self.all_tiled:
            return self.float_rows
        return min([self.float_rows] + [m.kernel_max_rows for m in self.packed_methods])

    def usable(self) -> bool:
        """Same weights as when planned and no hooks that eager mode would run. The pins
        are scanned only when a weight may have been assigned since the last scan that found
        them all held (layers/weight_swaps.py)."""
        from torch.nn.modules import module as torch_module
        if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
            return False
        swaps = weight_swaps.count()
        if swaps != self._pins_seen_at:
            stores, names, pins = self._pin_columns
            if any(map(operator.is_not, map(dict.get, stores, names), pins)):
                return False
            self._pins_seen_at = swaps
        return not self._has_hooks()

    def _has_hooks(self) -> bool:
        """Does a module of the stack have a forward (pre-)hook? Every registration takes a
        RemovableHandle, whose ids count registrations process-wide: while the count is the
        one of a scan that found none, none was added (removals only empty the dicts). A
        step then touches one counter instead of two dicts per module (several hundred
        objects, each a cache miss after the step's weights have streamed through)."""
        registered = torch_hooks.RemovableHandle.next_id
        if registered == self._no_hooks_at:
            return False
        if any(self.hook_dicts):
            return True
        self._no_hooks_at = registered
        return False

    def cache_ptrs(self, kv_caches: list) -> Optional[tuple]:
        """(k, v, k scales or None, v scales or None, value type code) address arrays; None
        for caches the C path does not write (float32 / float16 / bfloat16 and int8 are)."""
        if len(kv_caches) != len(self._caches) or any(
                a is not b for pair, old in zip(kv_caches, self._caches) for a, b in zip(pair, old)):
            # the attention kernel's reader: float caches, or int8 with per-slot scales
            parts = [cpu_ops._cache_parts(c) for pair in kv_caches for c in pair]
            if any(p[0] is None for p in parts) or len({p[2] for p in parts}) != 1:
                return None

            def addresses(items):
                return torch.tensor([t.data_ptr() for t in items], dtype=torch.int64)
            values, scales = [p[0] for p in parts], [p[1] for p in parts]
            self._ptrs = (addresses(values[0::2]), addresses(values[1::2]),
                          None if scales[0] is None else addresses(scales[0::2]),
                          None if scales[0] is None else addresses(scales[1::2]),
                          parts[0][2])
            self.block_size = values[0].shape[1]
            self._caches = [tuple(pair) for pair in kv_caches]   # referenced: addresses stay valid
        return self._ptrs

    def positions_ok(self, positions: torch.Tensor, step_cache: Optional[dict]) -> bool:
        """Every position inside every RoPE table the layers use (the kernel indexes them
        unchecked)."""
        return all(rotary._fused_ok(positions, step_cache) for rotary in self.rotaries)
