"""Decode of a whole decoder stack in one C call (layers/cpu_decode.c): a decode executor
the model runner chooses per step instead of the model's modules.

Eager PyTorch spends several milliseconds per decode step on Python: ~10 module calls and
~10 kernel calls per layer. When a step is decode-sized (at most ``cpu_ops.LINEAR_MAX_ROWS``
tokens) and every layer is one the C loop replicates (runner/fused_plan.py: Llama, Mistral,
Qwen2 / Qwen3, Gemma 3 dense layers; linears float32 or packed for the quantized kernel,
with float or int8-rounded (q8) activations as the quantized linears would take them;
float or int8 KV cache; no hooks), the layers run back to back in C: the same kernels in
the same order, so the hidden states are bit-identical to the module path. Anything else
returns None and the caller runs its modules.

MoE models (every layer's FFN a ``SparseMoE``) take it layer by layer: the C call runs a
layer's attention half and returns the normed FFN input; the experts run as modules on it.

It never runs a tensor-parallel model: its C loop has no all-reduce between the split
layers, so a rank would return its partial sums as if they were the hidden states.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn

from tokenmill.layers import cpu_ops, native
from tokenmill.runner.fused_plan import DEC_FIELDS, DEC_PARTS, StackPlan, is_fp32_cpu, stack_kind, stack_plan

__all__ = ["DEC_FIELDS", "DEC_PARTS", "StackPlan", "forward", "may_apply", "run_layers",
           "stack_kind", "stack_plan"]


def may_apply(model: nn.Module, num_tokens: int, meta, backend) -> bool:
    """The cheap checks, before the runner computes the embeddings for this path."""
    if not (0 < num_tokens <= cpu_ops.LINEAR_MAX_ROWS and getattr(backend, "name", None) == "cpu"
            and backend.cpu_kernels and cpu_ops.available()):
        return False
    from tokenmill.layers.attention.cpu import MAX_BATCHED_QUERY_LEN
    if meta.max_query_len > MAX_BATCHED_QUERY_LEN or any(meta.prompt_runs):
        # the module path attends to longer runs, and to prompt rows, with the prefill
        # attention: not the same numerics as the stack's decode attention
        return False
    return stack_plan(model) is not None


def forward(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
            meta, backend, aux=None) -> Optional[torch.Tensor]:
    """The model's hidden states [T, hidden] (after the final norm) through the C stack, or
    None when this step must run the modules. ``aux``: as the model's forward takes it."""
    if not may_apply(model, input_ids.shape[0], meta, backend):
        return None
    out = run_layers(model, model.embed(input_ids), positions, kv_caches, meta, backend, aux)
    return None if out is None else model.model.norm(out)


def run_layers(model: nn.Module, x: torch.Tensor, positions: torch.Tensor, kv_caches: list,
               meta, backend, aux=None) -> Optional[torch.Tensor]:
    """x [T, hidden] embeddings -> the stack's output (before the final norm), or None when
    the fused path does not apply. With ``aux`` the C stack copies the outputs of the layers
    it wants as it goes (the module path's bits, still one call)."""
    t = x.shape[0]
    if not (may_apply(model, t, meta, backend) and is_fp32_cpu(x) and positions.dtype is torch.int64):
        return None
    plan = stack_plan(model)
    if plan is None or len(kv_caches) != plan.num_layers or not plan.usable():
        return None
    activations = plan.activations()
    if activations is None or t > plan.max_rows(activations):
        return None   # mixed activation modes, float ones over tiled-only weights, or more
        #               rows than a streaming kernel takes: modules
    caches = plan.cache_ptrs(kv_caches)
    if caches is None:
        return None
    positions = positions.contiguous()
    if not plan.positions_ok(positions, meta.plan_cache):
        return None   # positions outside the RoPE tables
    x = x.contiguous().clone()
    h, hq, hkv, d, i = plan.hidden, plan.heads, plan.kv_heads, plan.head_dim, plan.inter
    nqkv = (hq + 2 * hkv) * d
    scratch = torch.empty(t * (2 * h + nqkv + hq * d + 3 * i + max(nqkv, 2 * i, h)
                               + max(h, hq * d, i)), dtype=torch.float32)
    layer_kv, _keep = layer_cache_views(meta, plan.windows)
    q_start = meta.query_start_loc[:-1].contiguous()
    q_len = torch.tensor(meta.query_lens, dtype=torch.int64)
    seq_len = meta.seq_lens.contiguous()
    # draft trees: each row's attention position (a leaf alternative's below its index
    # position), the paged kernel reads its own key from its written slot; None: chains
    q_pos = meta.checked_query_positions()
    kc, vc, ks, vs, kv_code = caches

    def call(first: int, count: int, ffn_in, aux_out=None, aux_cols=None) -> None:
        def at(addresses, fields=1):   # the address array from layer ``first`` on
            return None if addresses is None else addresses.data_ptr() + 8 * fields * first
        failed = native.library().tm_llama_decode(
            x.data_ptr(), t, h, count, plan.layers[first].data_ptr(), at(kc), at(vc), at(ks), at(vs),
            kv_code, hq, hkv, d, i, positions.data_ptr(), plan.block_size, at(layer_kv, 3),
            len(meta.query_lens), q_start.data_ptr(),
            q_len.data_ptr(), seq_len.data_ptr(), None if q_pos is None else q_pos.data_ptr(),
            scratch.data_ptr(),
            None if ffn_in is None else ffn_in.data_ptr(), int(activations == "q8"),
            torch.get_num_threads(), None if aux_out is None else aux_out.data_ptr(),
            None if aux_cols is None else aux_cols.data_ptr(), 0 if aux is None else len(aux.layers))
        if failed:
            raise MemoryError("fused decode: the " + ("attention" if failed == 1 else "quantized or bf16 matmul")
                              + " kernel could not allocate its buffer")

    if plan.moe_ffns is None:
        if aux is None:
            call(0, plan.num_layers, None)
        else:   # one call: the C stack copies each wanted layer's output into its columns
            joined = torch.empty(t, len(aux.layers) * h, dtype=torch.float32)
            call(0, plan.num_layers, None, joined, aux_columns(aux.layers, plan.num_layers))
            aux.offer_joined(joined)
        return x
    ffn_in = torch.empty(t, h, dtype=torch.float32)
    for layer, ffn in enumerate(plan.moe_ffns):
        call(layer, 1, ffn_in)     # attention half; ffn_in = post-attention norm of x
        x = x + ffn(ffn_in)        # as the decoder layer adds its FFN output
        if aux is not None:
            aux.offer(layer, x)
    return x


def layer_cache_views(meta, windows: tuple) -> tuple[torch.Tensor, list]:
    """[L, 3] int64 (cpu_decode.c's LKV_*): each layer's slots, block tables and table width,
    those of its KV group (``meta.for_window``), and the tensors the addresses point into
    (keep them alive for the call). One row per distinct window, spread to the layers."""
    distinct, layer_row = _window_rows(windows)
    keep, rows = [], []
    for window in distinct:
        m = meta.for_window(window)
        slots, tables = m.slot_mapping.contiguous(), m.block_tables.contiguous()
        keep += [slots, tables]
        rows.append([slots.data_ptr(), tables.data_ptr(), tables.shape[1]])
    return torch.tensor([rows[r] for r in layer_row], dtype=torch.int64), keep


@functools.lru_cache(maxsize=8)
def _window_rows(windows: tuple) -> tuple[tuple, tuple]:
    """(the distinct windows, each layer's index among them), once per model."""
    distinct = tuple(dict.fromkeys(windows))
    return distinct, tuple(distinct.index(w) for w in windows)


@functools.lru_cache(maxsize=8)
def aux_columns(layers: tuple[int, ...], num_layers: int) -> torch.Tensor:
    """[num_layers] int64: the column block of each layer's output in the joined features
    (the order ``layers`` asks them in), -1 for a layer no one reads. Built once per layer
    set (every decode step asks; the C stack only reads it)."""
    cols = torch.full((num_layers,), -1, dtype=torch.int64)
    for i, layer in enumerate(layers):
        cols[layer] = i
    return cols
