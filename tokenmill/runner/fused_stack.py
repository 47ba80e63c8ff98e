"""Decode of a whole Llama decoder stack in one C call (layers/cpu_decode.c): a decode
executor the model runner chooses per step instead of the model's modules.

Eager PyTorch spends several milliseconds per decode step on Python: ~10 module calls and
~10 kernel calls per layer. When a step is decode-sized (at most ``cpu_ops.LINEAR_MAX_ROWS``
tokens) and the model is a plain Llama stack on the fused CPU kernels (linears without
biases, float32 or packed for the quantized kernel, with float or int8-rounded (q8)
activations as the quantized linears would take them; float32 or int8 KV cache; RMSNorm,
SiLU, RoPE; no sliding window, no q/k norm, no hooks), the layers run back to back in C:
the same kernels in the same order, so the hidden states are bit-identical to the module
path. Anything else returns None and the caller runs its modules.

MoE models (every layer's FFN a ``SparseMoE``) take it layer by layer: the C call runs a
layer's attention half and returns the normed FFN input; the experts run as modules on it.

It never runs a tensor-parallel model: its C loop has no all-reduce between the split
layers, so a rank would return its partial sums as if they were the hidden states.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tokenmill.layers import cpu_ops, native


DEC_PARTS, DEC_FIELDS = 4, 10   # cpu_decode.c: parts per linear, int64 fields per part
_NO_PART = [-2] + [0] * (DEC_FIELDS - 1)


def _linear_desc(lin: nn.Module) -> Optional[tuple[list[int], object]]:
    """cpu_decode.c's descriptor of one linear and the object whose identity pins it (the
    float weight, or the packed-parts list), or None when the C path cannot run it exactly
    as the module would."""
    from tokenmill.layers.quant import kernels
    from tokenmill.layers.quant.matmul import _KINDS, kernel_applies
    from tokenmill.layers.quant.methods import PackedLinearMethod, UnquantizedLinearMethod
    method = lin.quant_method
    if lin.bias is not None:
        return None
    if type(method) is UnquantizedLinearMethod:
        w = getattr(lin, "weight", None)
        if not (_fp32_cpu(w) and w.is_contiguous()):
            return None
        float_part = [-1, w.data_ptr(), 0, 0, 0, w.shape[0]]
        return float_part + [0] * (DEC_FIELDS - len(float_part)) + _NO_PART * (DEC_PARTS - 1), w
    if not (isinstance(method, PackedLinearMethod) and type(method).apply is PackedLinearMethod.apply
            and method.use_kernel and method.kernel_max_rows >= cpu_ops.LINEAR_MAX_ROWS):
        return None
    parts = lin.packed
    if not parts or len(parts) > DEC_PARTS or not all(kernel_applies(p) for p in parts):
        return None
    desc = []
    for p in parts:
        if p.perm is not None and not (p.perm.dtype is torch.int64 and p.perm.is_contiguous()
                                       and p.perm.numel() == p.in_features):
            return None
        desc += [kernels.kind_code(_KINDS[p.kind], p.scales), p.qweight.data_ptr(), p.scales.data_ptr(),
                 p.mins.data_ptr() if p.mins is not None else 0, p.group_size, p.out_features,
                 p.perm.data_ptr() if p.perm is not None else 0] + _tiled_fields(p)
    return desc + _NO_PART * (DEC_PARTS - len(parts)), parts


def _tiled_fields(p) -> list[int]:
    """The tiled copy's addresses (qw, sc, mn or 0) for q8 steps, zeros without one."""
    t = p.tiled
    if t is None:
        return [0, 0, 0]
    return [t.qw.data_ptr(), t.sc.data_ptr(), t.mn.data_ptr() if t.mn is not None else 0]


class _StackPlan:
    """Per-model constants of the fused stack: dims, norm-weight addresses and the linear
    descriptors (float32 weights or packed parts the quantized kernel reads)."""

    def __init__(self, model: nn.Module, descs: list, moe_ffns: Optional[list] = None) -> None:
        layers = model.model.layers
        a0 = layers[0].self_attn
        self.hidden = model.args.hidden_size
        self.heads, self.kv_heads, self.head_dim = a0.num_heads, a0.num_kv_heads, a0.head_dim
        self.moe_ffns = moe_ffns   # MoE: each layer's SparseMoE, run between the C calls
        self.inter = 0 if moe_ffns else layers[0].mlp.down_proj.in_features
        self.eps = float(layers[0].input_layernorm.eps)
        self.scale = float(a0.scale)
        self.rotary = a0.rotary
        self.num_layers = len(layers)
        # each module's hook dicts (registering a hook fills them; they are not replaced)
        self.hook_dicts = [d for layer in layers for m in layer.modules()
                           for d in (m._forward_hooks, m._forward_pre_hooks)]
        # The C side gets raw addresses: keep what they point into referenced, and check
        # per call that the modules still hold exactly these objects.
        norms = [(n, n.weight) for layer in layers
                 for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        # (where the module keeps it, its name, the object planned): packed parts live in
        # the module's __dict__, parameters in its _parameters
        self.pins = [(n._parameters, "weight", w) for n, w in norms] + [
            (lin.__dict__, "packed", pin) if isinstance(pin, list) else (lin._parameters, "weight", pin)
            for lin, _, pin in descs]
        self.ln1 = torch.tensor([l.input_layernorm.weight.data_ptr() for l in layers], dtype=torch.int64)
        self.ln2 = torch.tensor([l.post_attention_layernorm.weight.data_ptr() for l in layers],
                                dtype=torch.int64)
        rows = [v for _, desc, _ in descs for v in desc]   # MoE: qkv and o only; C keeps 4 slots
        if moe_ffns:
            width = len(descs[0][1])
            rows = [v for layer in range(len(layers))
                    for v in rows[layer * 2 * width:(layer + 1) * 2 * width] + _NO_PART * DEC_PARTS * 2]
        self.linears = torch.tensor(rows, dtype=torch.int64)
        self._caches: list = []
        self.packed_methods = list({id(lin.quant_method): lin.quant_method
                                    for lin, _, pin in descs if isinstance(pin, list)}.values())

    def activations(self) -> Optional[str]:
        """"q8" / "fp32": what every packed linear takes now ("fp32" without packed
        linears); None if they differ."""
        modes = {m.activations for m in self.packed_methods}
        return modes.pop() if len(modes) == 1 else ("fp32" if not modes else None)

    def usable(self) -> bool:
        """Same weights as when planned and no hooks that eager mode would run."""
        from torch.nn.modules import module as torch_module
        if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
            return False
        if any(store.get(name) is not pin for store, name, pin in self.pins):
            return False
        return not any(self.hook_dicts)

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


def _fp32_cpu(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype is torch.float32 and t.device.type == "cpu"


def stack_plan(model: nn.Module) -> Optional[_StackPlan]:
    """The model's plan, or None when its stack is not the plain Llama one (cached)."""
    plan = model.__dict__.get("_fused_stack_plan", False)
    if plan is False:
        plan = None
        kind = _plain_llama_stack(model)
        if kind is not None:
            descs = []
            for layer in model.model.layers:
                a = layer.self_attn
                linears = (a.qkv_proj, a.o_proj) if kind == "moe" else \
                    (a.qkv_proj, a.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
                for lin in linears:
                    desc = _linear_desc(lin)
                    if desc is None:
                        break
                    descs.append((lin, *desc))
            per_layer = 2 if kind == "moe" else 4
            if len(descs) == per_layer * len(model.model.layers):
                ffns = [layer._modules[layer.ffn_name] for layer in model.model.layers] if kind == "moe" else None
                plan = _StackPlan(model, descs, ffns)
        model.__dict__["_fused_stack_plan"] = plan
    return plan


def _plain_llama_stack(model: nn.Module) -> Optional[str]:
    """"dense" (the whole layer in C), "moe" (attention in C, experts as modules) or None."""
    if getattr(model, "tp", None) is not None and model.tp.size != 1:
        return None   # split layers need their all-reduces
    from tokenmill.layers.activation import SiluAndMul
    from tokenmill.layers.norm import RMSNorm
    from tokenmill.layers.rotary import RotaryEmbedding
    from tokenmill.layers.moe import SparseMoE
    from tokenmill.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
    from tokenmill.models.mixtral import MixtralDecoderLayer
    layers = list(model.model.layers)
    if not layers:
        return None
    if not all(type(layer) in (LlamaDecoderLayer, MixtralDecoderLayer) for layer in layers):
        return None   # other decoders (Gemma3's sandwich norms) have their own layer shape
    a0, n0 = layers[0].self_attn, layers[0].input_layernorm
    moe = all(type(layer._modules.get(layer.ffn_name)) is SparseMoE for layer in layers)
    for layer in layers:
        a, m = layer.self_attn, layer._modules.get(layer.ffn_name)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        ffn_ok = moe or (type(layer) is LlamaDecoderLayer and type(m) is LlamaMLP and type(m.act) is SiluAndMul)
        if not (type(layer) in (LlamaDecoderLayer, MixtralDecoderLayer) and type(a) is LlamaAttention and ffn_ok
                and all(type(n) is RMSNorm and n.eps == n0.eps and _fp32_cpu(n.weight) for n in norms)
                and type(a.rotary) is RotaryEmbedding
                and a.rotary is a0.rotary and a.q_norm is None and a.sliding_window is None
                and a.scale == a0.scale and a.head_dim % 2 == 0
                and a.clip_qkv is None
                and (a.num_heads, a.num_kv_heads, a.head_dim) == (a0.num_heads, a0.num_kv_heads, a0.head_dim)):
            return None
    if not (_fp32_cpu(a0.rotary.cos) and a0.rotary.cos.is_contiguous() and a0.rotary.sin.is_contiguous()):
        return None
    return "moe" if moe else "dense"


def may_apply(model: nn.Module, num_tokens: int, meta, backend) -> bool:
    """The cheap checks, before the runner computes the embeddings for this path."""
    if not (0 < num_tokens <= cpu_ops.LINEAR_MAX_ROWS and getattr(backend, "name", None) == "cpu"
            and backend.cpu_kernels and cpu_ops.available()):
        return False
    from tokenmill.layers.attention.cpu import MAX_BATCHED_QUERY_LEN
    if meta.max_query_len > MAX_BATCHED_QUERY_LEN:
        return False   # the module path attends to longer runs with SDPA: not the same numerics
    return stack_plan(model) is not None


def forward(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
            meta, backend, aux=None) -> Optional[torch.Tensor]:
    """The model's hidden states [T, hidden] (after the final norm) through the C stack, or
    None when this step must run the modules. ``aux``: as the model's forward takes it."""
    if not may_apply(model, input_ids.shape[0], meta, backend):
        return None
    out = run_layers(model, model.model.embed_tokens(input_ids), positions, kv_caches, meta,
                     backend, aux)
    return None if out is None else model.model.norm(out)


def run_layers(model: nn.Module, x: torch.Tensor, positions: torch.Tensor, kv_caches: list,
               meta, backend, aux=None) -> Optional[torch.Tensor]:
    """x [T, hidden] embeddings -> the stack's output (before the final norm), or None when
    the fused path does not apply. With ``aux`` the C stack stops after each layer it wants
    (one call per run of layers), so the captured rows are the module path's bits."""
    t = x.shape[0]
    if not (may_apply(model, t, meta, backend) and _fp32_cpu(x) and positions.dtype is torch.int64):
        return None
    plan = stack_plan(model)
    if plan is None or len(kv_caches) != plan.num_layers or not plan.usable():
        return None
    activations = plan.activations()
    if activations is None:
        return None   # layers set to different activation modes: the modules run them
    caches = plan.cache_ptrs(kv_caches)
    if caches is None:
        return None
    positions = positions.contiguous()
    if not plan.rotary._fused_ok(positions, meta.plan_cache):
        return None   # positions outside the RoPE tables (the kernel indexes them unchecked)
    x = x.contiguous().clone()
    h, hq, hkv, d, i = plan.hidden, plan.heads, plan.kv_heads, plan.head_dim, plan.inter
    nqkv = (hq + 2 * hkv) * d
    scratch = torch.empty(t * (2 * h + nqkv + hq * d + 3 * i + max(nqkv, 2 * i, h)
                               + max(h, hq * d, i)), dtype=torch.float32)
    tables = meta.block_tables.contiguous()
    q_start = meta.query_start_loc[:-1].contiguous()
    q_len = torch.tensor(meta.query_lens, dtype=torch.int64)
    seq_len = meta.seq_lens.contiguous()
    slots = meta.slot_mapping.contiguous()
    kc, vc, ks, vs, kv_code = caches

    def call(first: int, count: int, ffn_in) -> None:
        def at(addresses):   # the address array from layer ``first`` on
            return None if addresses is None else addresses.data_ptr() + 8 * first
        failed = native.library().tm_llama_decode(
            x.data_ptr(), t, h, count, at(plan.ln1), at(plan.ln2),
            plan.linears.data_ptr() + 8 * first * 4 * DEC_PARTS * DEC_FIELDS, at(kc), at(vc),
            at(ks), at(vs), kv_code, hq, hkv, d, i, plan.eps,
            plan.rotary.cos.data_ptr(), plan.rotary.sin.data_ptr(), positions.data_ptr(),
            slots.data_ptr(), plan.block_size, tables.data_ptr(), tables.shape[1],
            len(meta.query_lens), q_start.data_ptr(), q_len.data_ptr(), seq_len.data_ptr(),
            plan.scale, scratch.data_ptr(), None if ffn_in is None else ffn_in.data_ptr(),
            int(activations == "q8"), torch.get_num_threads())
        if failed:
            raise MemoryError("fused decode: the " + ("attention" if failed == 1 else "quantized matmul")
                              + " kernel could not allocate its buffer")

    if plan.moe_ffns is None:
        first = 0
        for end in _segment_ends(plan.num_layers, aux):
            call(first, end - first, None)
            if aux is not None and aux.wants(end - 1):
                aux.offer(end - 1, x.clone())   # the C calls go on updating x in place
            first = end
        return x
    ffn_in = torch.empty(t, h, dtype=torch.float32)
    for layer, ffn in enumerate(plan.moe_ffns):
        call(layer, 1, ffn_in)     # attention half; ffn_in = post-attention norm of x
        x = x + ffn(ffn_in)        # as the decoder layer adds its FFN output
        if aux is not None:
            aux.offer(layer, x)
    return x


def _segment_ends(num_layers: int, aux) -> list[int]:
    """Where each C call stops: after every layer ``aux`` wants, and at the end."""
    wanted = [] if aux is None else [layer + 1 for layer in aux.layers if layer + 1 < num_layers]
    return sorted(set(wanted)) + [num_layers]
