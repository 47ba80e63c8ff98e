"""Tensor-shape validation of a GGUF checkpoint against the HF config derived from it.

``check_tensors`` runs at open time: every weight the config implies must be present with
the right shape and nothing unexpected may be stored. It knows HF shapes only; the
llama.cpp -> HF naming is passed in (``spec``, ``hf_names``) by gguf_llama, which imports
this module, so the two never import each other.
"""

from __future__ import annotations

import re
from itertools import islice
from typing import Any, Callable, Iterator, Optional

from .errors import CheckpointError
from .gguf_reader import GGUFFile

# llama.cpp reads the shared-expert gate as [hidden]; HF's is a [1, hidden] Linear weight.
ONE_ROW = "ffn_gate_inp_shexp"

# Canonical ASCII indices only: "01" or a non-ASCII digit would name a second copy of a weight.
_HF_LAYER_RE = re.compile(r"model\.layers\.(0|[1-9][0-9]*)\.(.+)\.weight")
_HF_EXPERT_RE = re.compile(r"\.experts\.(0|[1-9][0-9]*)\.")

# (GGUF tensor name, experts a stacked tensor holds) -> [(HF name, expert or None)]
NamesOf = Callable[[str, int], list[tuple[str, Optional[int]]]]


def num_experts(cfg: dict[str, Any]) -> int:
    """Routed experts per MoE layer (0: a dense model), whatever the HF config calls them."""
    return cfg.get("num_local_experts") or cfg.get("num_experts") or 0


def tensor_kind(gguf_name: str) -> str:
    """The per-layer kind of a GGUF tensor name ("attn_q" in blk.0.attn_q.weight), else ""."""
    return gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""


def _global_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _per_layer_shapes(cfg: dict[str, Any], spec) -> dict[str, tuple[int, ...]]:
    """HF module -> weight shape (numpy order), for one layer of this config's architecture;
    an expert module appears once, with "{e}" for its index. spec: gguf_llama's ArchSpec."""
    hidden, ffn, head_dim = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q_rows, kv_rows = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    kind = cfg["model_type"]
    shapes = {"self_attn.q_proj": (q_rows, hidden), "self_attn.k_proj": (kv_rows, hidden),
              "self_attn.v_proj": (kv_rows, hidden), "self_attn.o_proj": (hidden, q_rows),
              "input_layernorm": (hidden,), "post_attention_layernorm": (hidden,)}
    if spec.expert_names:
        shapes.update(_moe_shapes(spec, cfg))
    else:
        shapes.update({"mlp.gate_proj": (ffn, hidden), "mlp.up_proj": (ffn, hidden), "mlp.down_proj": (hidden, ffn)})
    if kind in ("qwen3", "gemma3_text", "qwen3_moe"):
        shapes.update({"self_attn.q_norm": (head_dim,), "self_attn.k_norm": (head_dim,)})
    if kind == "olmoe":  # OLMoE normalises the whole projection, not each head
        shapes.update({"self_attn.q_norm": (q_rows,), "self_attn.k_norm": (kv_rows,)})
    if kind == "gemma3_text":
        shapes.update({"pre_feedforward_layernorm": (hidden,), "post_feedforward_layernorm": (hidden,)})
    return shapes


def _moe_shapes(spec, cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, names, layer = cfg["hidden_size"], spec.expert_names, spec.layer_names
    ffn = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]  # Qwen's key, else Mixtral's / OLMoE's
    shapes = {layer["ffn_gate_inp"]: (num_experts(cfg), hidden), names["ffn_gate"]: (ffn, hidden),
              names["ffn_up"]: (ffn, hidden), names["ffn_down"]: (hidden, ffn)}
    if "ffn_gate_shexp" in layer:
        shared = cfg["shared_expert_intermediate_size"]
        shapes.update({layer["ffn_gate_shexp"]: (shared, hidden), layer["ffn_up_shexp"]: (shared, hidden),
                       layer["ffn_down_shexp"]: (hidden, shared), layer[ONE_ROW]: (1, hidden)})
    return shapes


def _expected_shape(cfg: dict[str, Any], name: str, per_layer: dict, global_shapes: dict) -> Optional[tuple]:
    """Shape of the HF weight ``name`` in a model of this config; None if it has no such weight."""
    if name in global_shapes:
        return global_shapes[name]
    m = _HF_LAYER_RE.fullmatch(name)
    if m is None or not _below(m.group(1), cfg["num_hidden_layers"]):
        return None
    module, e = m.group(2), _HF_EXPERT_RE.search(m.group(2))
    if e is not None:
        if not _below(e.group(1), num_experts(cfg)):
            return None
        module = f"{module[:e.start()]}.experts.{{e}}.{module[e.end():]}"
    return per_layer.get(module)


def _below(digits: str, limit: int) -> bool:
    """``int(digits) < limit`` without converting a hostile 5000-digit index (Python refuses
    to parse more than 4300 digits; anything longer than the limit is past it anyway)."""
    return len(digits) <= len(str(limit)) and int(digits) < limit


def _expected_names(cfg: dict[str, Any], per_layer: dict, global_shapes: dict) -> Iterator[str]:
    yield from global_shapes
    for i in range(cfg["num_hidden_layers"]):
        for module in per_layer:
            for e in range(num_experts(cfg) if "{e}" in module else 1):
                yield f"model.layers.{i}.{module.format(e=e)}.weight"


def check_tensors(gguf: GGUFFile, cfg: dict[str, Any], spec, hf_names: NamesOf) -> None:
    """Every weight the config implies is present with the right shape, nothing unexpected.

    spec: the config's architecture (gguf_llama's ArchSpec: layer_names, expert_names);
    hf_names: that architecture's GGUF -> HF name mapping.
    Done at open time so a lying config (say a billion layers or experts) fails before any
    model is built; nothing here is sized by a count the tensors have not confirmed.
    """
    num_layers, experts = cfg["num_hidden_layers"], num_experts(cfg)
    per_layer, global_shapes = _per_layer_shapes(cfg, spec), _global_shapes(cfg)
    if num_layers * len(per_layer) > len(gguf.tensors):  # a lying count, not a model
        raise CheckpointError(f"{gguf.path}: {len(gguf.tensors)} tensors cannot hold {num_layers} layers")
    seen: set[str] = set()
    for gguf_name, info in gguf.tensors.items():
        # A stacked tensor names no more experts than it holds; the shape check then
        # rejects an expert count it does not hold.
        for name, expert in hf_names(gguf_name, min(experts, info.shape[0])):
            bias = name.endswith(".bias")  # biases follow their weight's output rows
            want = _expected_shape(cfg, name[:-5] + ".weight" if bias else name, per_layer, global_shapes)
            if want is None:
                raise CheckpointError(f"{gguf.path}: tensor {gguf_name!r} does not fit the config ({num_layers} "
                                      f"layers, {experts} experts, tied={cfg['tie_word_embeddings']})")
            want = (want[:1] if bias else want) if expert is None else (experts, *(want[:1] if bias else want))
            shape = want if tensor_kind(gguf_name) == ONE_ROW and info.shape == want[1:] else info.shape
            if shape != want:
                raise CheckpointError(f"{gguf.path}: tensor {gguf_name!r} has shape {info.shape}, expected {want}")
            if name in seen:
                raise CheckpointError(f"{gguf.path}: {name} is stored twice (last in {gguf_name!r})")
            seen.add(name)
    total = len(global_shapes) + num_layers * sum(experts if "{e}" in m else 1 for m in per_layer)
    if sum(not n.endswith(".bias") for n in seen) < total:  # only expected names get in: some are missing
        missing = islice((n for n in _expected_names(cfg, per_layer, global_shapes) if n not in seen), 5)
        raise CheckpointError(f"{gguf.path}: missing tensors: {', '.join(missing)}")
