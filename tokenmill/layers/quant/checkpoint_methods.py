"""Strategies for weights that arrive already quantized: GPTQ and AWQ (AutoGPTQ / AutoAWQ
tensor layouts), FP8 checkpoints, and GGUF Q8_0 / Q4_0 / Q4_1 tensors. Each loads the
checkpoint's own tensors, then repacks them into a ``formats.Packed`` after loading.

Layouts (N = out_features, K = in_features, ng = number of groups):
  GPTQ (v1 "gptq" format): qweight int32 [K*bits/32, N] packed along K, low bits first;
    qzeros int32 [ng, N*bits/32] storing zero - 1; scales [ng, N]; g_idx int32 [K].
  AWQ (GEMM): qweight int32 [K, N/8] packed along N in the order 0,2,4,6,1,3,5,7; qzeros
    int32 [ng, N/8] same order, no offset; scales [ng, N].
  FP8: weight float8_e4m3fn [N, K]; weight_scale [N] / [N, 1] / scalar.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.quant import formats
from tokenmill.layers.quant.formats import Packed
from tokenmill.layers.quant.methods import (PackedLinearMethod, UnquantizedLinearMethod,
                                            new_param, set_packed)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # nibble j of an AWQ int32 holds column AWQ_ORDER[j]


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32/bits fields (low bits first), expanded along ``dim``."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    fields = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)     # [..., per]
    if dim == 0:   # [R, C] -> [R, C, per] -> [R, per, C] -> [R * per, C]
        return fields.permute(0, 2, 1).reshape(packed.shape[0] * per, packed.shape[1])
    return fields.reshape(packed.shape[0], packed.shape[1] * per)


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of ``unpack_int32`` for non-negative values < 2**bits."""
    per = 32 // bits
    v = values.to(torch.int64)
    if dim == 0:
        v = v.reshape(v.shape[0] // per, per, v.shape[1]).permute(0, 2, 1)
    else:
        v = v.reshape(v.shape[0], v.shape[1] // per, per)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = (v << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


class GPTQMethod(PackedLinearMethod):
    name = "gptq"

    def __init__(self, bits: int, group_size: int, **kw):
        super().__init__(**kw)
        if bits not in (4, 8):
            raise ValueError(f"GPTQ with {bits} bits is not supported (4 or 8)")
        self.bits, self.group_size = bits, group_size

    def create_weights(self, layer):
        k, n, per = layer.in_features, layer.out_features, 32 // self.bits
        g = self.group_size if self.group_size > 0 else k
        if k % g or k % per or any(s % per for s in layer.shard_sizes):
            raise ValueError(f"GPTQ layer [{n}, {k}] does not fit bits={self.bits}, group={g}")
        i32 = torch.int32
        new_param(layer, "qweight", torch.zeros(k // per, n, dtype=i32), output_dim=1,
                  input_dim=0, input_pack=per)
        new_param(layer, "qzeros", torch.zeros(k // g, n // per, dtype=i32), 1, per, 0, g)
        new_param(layer, "scales", torch.zeros(k // g, n), output_dim=1, input_dim=0, input_pack=g)
        g_idx = new_param(layer, "g_idx", torch.zeros(len(layer.shard_sizes), k, dtype=i32))
        g_idx.weight_loader = _per_shard_loader(layer)

    def process_weights_after_loading(self, layer):
        k, bits = layer.in_features, self.bits
        q = unpack_int32(layer.qweight.data, bits, dim=0).t()               # [N, K]
        zeros = ((unpack_int32(layer.qzeros.data, bits, dim=1) + 1) & ((1 << bits) - 1)).t()
        scales = layer.scales.data.t().float()                            # [N, ng]
        g_idx = layer.g_idx.data.long()
        g = k // scales.shape[1]
        if bool((g_idx == g_idx[0]).all()):
            parts = [_gptq_part(q, zeros, scales, g_idx[0], g, bits)]
        else:   # shards quantized with different act-orders run as separate matmuls
            rows = torch.tensor([0] + layer.shard_sizes).cumsum(0).tolist()
            parts = [_gptq_part(q[a:b], zeros[a:b], scales[a:b], g_idx[i], g, bits)
                     for i, (a, b) in enumerate(zip(rows, rows[1:]))]
        set_packed(layer, parts)


def _per_shard_loader(layer: nn.Module):
    """g_idx is per input column, so fused shards each keep their own row. A row-parallel
    rank keeps its columns, with group numbers counted from its first group."""
    def load(param, loaded, shard_id=None, name=""):
        row = 0 if shard_id is None else layer.shard_names.index(shard_id)
        if layer.parallel == "row" and layer.tp.is_parallel:
            k = layer.in_features
            loaded = loaded.narrow(0, layer.tp.rank * k, k)
            first = loaded.min() if loaded.numel() else 0
            if loaded.numel() and int(loaded.max() - first) * layer.quant_method.group_size >= k:
                raise ValueError(f"tensor {name!r}: act-order GPTQ groups span the ranks' input "
                                 "features; it cannot be split row-parallel")
            loaded = loaded - first
        if tuple(loaded.shape) != (param.shape[1],):
            raise ValueError(f"tensor {name!r} has shape {tuple(loaded.shape)}, expected ({param.shape[1]},)")
        param.data[row].copy_(loaded)
        if shard_id is None:
            param.data[:] = param.data[0]
    return load


def _gptq_part(q, zeros, scales, g_idx, group_size, bits) -> Packed:
    """Columns sorted by group (act-order) so groups are contiguous runs for the kernel."""
    k = q.shape[1]
    perm = None
    if not bool((g_idx == torch.arange(k) // group_size).all()):
        perm = torch.argsort(g_idx, stable=True)
        counts = torch.bincount(g_idx, minlength=scales.shape[1])
        if not bool((counts == group_size).all()):
            raise ValueError("GPTQ g_idx with unequal group sizes is not supported")
        q = q[:, perm]
    if bits == 4:
        return formats.int4_packed(q, scales, zeros, group_size, perm)
    if not bool((zeros == 128).all()):
        raise ValueError("8-bit GPTQ must be symmetric (zero point 128) for the int8 path")
    n = q.shape[0]
    return Packed("i8", (q.int() - 128).to(torch.int8).contiguous(), scales.contiguous(), None,
                  group_size, n, k, perm)


class AWQMethod(PackedLinearMethod):
    name = "awq"

    def __init__(self, group_size: int, **kw):
        super().__init__(**kw)
        self.group_size = group_size

    def create_weights(self, layer):
        k, n, g = layer.in_features, layer.out_features, self.group_size
        if k % g or any(s % 8 for s in layer.shard_sizes):
            raise ValueError(f"AWQ layer [{n}, {k}] does not fit group {g}")
        new_param(layer, "qweight", torch.zeros(k, n // 8, dtype=torch.int32), 1, 8, 0, 1)
        new_param(layer, "qzeros", torch.zeros(k // g, n // 8, dtype=torch.int32), 1, 8, 0, g)
        new_param(layer, "scales", torch.zeros(k // g, n), output_dim=1, input_dim=0, input_pack=g)

    def process_weights_after_loading(self, layer):
        q = awq_unpack(layer.qweight.data).t()          # [N, K]
        zeros = awq_unpack(layer.qzeros.data).t()       # [N, ng]
        set_packed(layer, [formats.int4_packed(q, layer.scales.data.t(), zeros, self.group_size)])


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """[R, C/8] int32 -> [R, C] values in natural column order."""
    fields = unpack_int32(packed, 4, dim=1).reshape(packed.shape[0], -1, 8)
    inverse = torch.argsort(torch.tensor(AWQ_ORDER))
    return fields[:, :, inverse].reshape(packed.shape[0], -1)


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """[R, C] values 0..15 -> [R, C/8] int32 in AWQ's column order."""
    r, c = values.shape
    ordered = values.reshape(r, c // 8, 8)[:, :, list(AWQ_ORDER)].reshape(r, c)
    return pack_int32(ordered, 4, dim=1)


class FP8CheckpointMethod(PackedLinearMethod):
    name = "fp8-ckpt"

    def create_weights(self, layer):
        n, k = layer.out_features, layer.in_features
        new_param(layer, "weight", torch.zeros(n, k, dtype=torch.float8_e4m3fn), input_dim=1)
        scale = new_param(layer, "weight_scale", torch.zeros(n, 1))
        scale.weight_loader = _scale_loader(layer)

    def process_weights_after_loading(self, layer):
        n, k = layer.out_features, layer.in_features
        # model.to(dtype) may have widened the float8 parameter; e4m3 values survive exactly
        q = layer.weight.data.to(torch.float8_e4m3fn).view(torch.uint8).contiguous()
        set_packed(layer, [Packed("f8", q, layer.weight_scale.data.float().contiguous(), None, k, n, k)])


def _scale_loader(layer: nn.Module):
    """Per-tensor (scalar) or per-channel ([N] / [N, 1]) scales, broadcast to [rows, 1]."""
    def load(param, loaded, shard_id=None, name=""):
        start, end = layer.shard_range(shard_id) if shard_id is not None else (0, param.shape[0])
        loaded = loaded.float().reshape(-1, 1)
        if loaded.shape[0] > 1 and layer.parallel == "column" and layer.tp.is_parallel:
            first, rows = layer.checkpoint_rows[shard_id]   # per-channel: this rank's rows
            loaded = loaded[first:first + rows]
        param.data[start:end] = loaded.expand(end - start, 1)
    return load


class GGUFMethod(PackedLinearMethod):
    """GGUF blocks kept packed (gguf.py repacks them): kind "i8" (Q8_0, Q5_0, Q6_K; Q5_1 and
    Q5_K with mins) or "i4" (Q4_0, Q4_1, Q4_K, with mins), groups of 32 values (16 for Q6_K)."""
    name = "gguf"

    def __init__(self, kind: str, group_size: int = 32, has_mins: bool = False, **kw):
        super().__init__(**kw)
        self.kind, self.group_size, self.has_mins = kind, group_size, has_mins or kind == "i4"

    def create_weights(self, layer):
        # torch.empty: pages nobody touches until the checkpoint fills them (load_weights
        # insists on every tensor), or never when the loader keeps the repacked array itself
        n, k, g = layer.out_features, layer.in_features, self.group_size
        if self.kind == "i8":
            new_param(layer, "qweight", torch.empty(n, k, dtype=torch.int8), input_dim=1)
        else:
            new_param(layer, "qweight", torch.empty(n, k // 2, dtype=torch.uint8), input_dim=1,
                      input_pack=2)
        if self.has_mins:
            new_param(layer, "mins", torch.empty(n, k // g), input_dim=1, input_pack=g)
        new_param(layer, "scales", torch.empty(n, k // g), input_dim=1, input_pack=g)

    def process_weights_after_loading(self, layer):
        n, k = layer.out_features, layer.in_features
        scales = layer.scales.data
        mins = layer.mins.data if self.has_mins else None
        # Block fields stored as fp16 in the file (or products of them that fp16 holds
        # exactly): kept as float16 they are half the bytes the matmul streams per step, with
        # the same values (checked: Q4_0's -8 d could overflow; K-quant products may not fit).
        half = [t.half() for t in (scales, mins) if t is not None]
        if all(torch.equal(h.float(), t) for h, t in zip(half, (scales, mins))):
            scales, mins = half[0], (half[1] if mins is not None else None)
        set_packed(layer, [Packed(self.kind, layer.qweight.data, scales, mins, self.group_size, n, k)])


def method_for(spec, module_name: str, layer: nn.Module, sources: list[str]):
    kw = dict(use_kernel=spec.use_kernel)
    qc = spec.config
    if spec.method == "gptq":
        return GPTQMethod(int(qc.get("bits", 4)), int(qc.get("group_size", 128)), **kw)
    if spec.method == "awq":
        return AWQMethod(int(qc.get("group_size", 128)), **kw)
    if spec.method == "fp8-ckpt":
        return FP8CheckpointMethod(**kw)
    if spec.method == "gguf":
        from tokenmill.layers.quant.gguf import GROUP_SIZE, HAS_MINS, PACKED_KIND
        types = {qc["types"].get(s, "") for s in sources}
        layouts = {(PACKED_KIND.get(t), GROUP_SIZE.get(t), HAS_MINS.get(t)) for t in types}
        if len(layouts) == 1 and (None, None, None) not in layouts:   # fused shards: one layout
            return GGUFMethod(*layouts.pop(), **kw)
        return UnquantizedLinearMethod()
    raise ValueError(f"unknown quantization method {spec.method!r}")

