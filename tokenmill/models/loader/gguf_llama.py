"""GGUF (llama.cpp) conventions -> Hugging Face conventions, for the llama-like
architectures (llama, qwen2, qwen3, gemma3) and their Mixture-of-Experts kin (Mixtral,
which llama.cpp files as llama with experts, qwen2moe, qwen3moe, olmoe).

Translations: metadata keys -> an HF ``config.json`` dict, tensor names -> HF parameter
names (a stacked ``ffn_*_exps`` tensor [experts, rows, cols] -> one HF weight per expert),
q/k weights back from llama.cpp's RoPE row order to HF's (llama only), and Gemma's norm
weights back from llama.cpp's ``1 + w`` to HF's ``w``. Checking the tensors' shapes against
the config lives in gguf_shapes (``check_tensors`` here binds it to these name tables).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import numpy as np

from . import gguf_shapes
from .errors import CheckpointError
from .gguf_quants import dequantize
from .gguf_reader import GGUFFile
from .gguf_shapes import ONE_ROW, num_experts, tensor_kind


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ATTN_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_NAMES = {**_ATTN_NAMES, "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma's converter renames the sandwich norms: its ffn_norm is HF's pre-feedforward norm.
_GEMMA_NORMS = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
# MoE layers: the router is ffn_gate_inp; experts are keyed by their dense kind (ffn_gate ->
# ffn_gate_exps stacked, or ffn_gate.E split), "{e}" standing for the expert index.
_MIXTRAL_MOE = {"ffn_gate_inp": "block_sparse_moe.gate"}
_MIXTRAL_EXPERTS = {"ffn_gate": "block_sparse_moe.experts.{e}.w1", "ffn_up": "block_sparse_moe.experts.{e}.w3",
                    "ffn_down": "block_sparse_moe.experts.{e}.w2"}
_QWEN_MOE = {"ffn_gate_inp": "mlp.gate"}
_QWEN_EXPERTS = {"ffn_gate": "mlp.experts.{e}.gate_proj", "ffn_up": "mlp.experts.{e}.up_proj",
                 "ffn_down": "mlp.experts.{e}.down_proj"}
_SHARED_EXPERT = {"ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                  "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}


@dataclass(frozen=True)
class ArchSpec:
    """How one llama.cpp architecture maps onto an HF one."""
    hf_architecture: str
    model_type: str
    layer_names: dict = field(default_factory=lambda: dict(_LAYER_NAMES))
    permuted_qk: bool = False  # llama.cpp's converter reorders q/k rows (llama only)
    norm_shift: float = 0.0  # the converter stored norm weights + this (Gemma: 1)
    expert_names: dict = field(default_factory=dict)  # dense kind -> HF expert module ("{e}")


# Keys are llama.cpp's general.architecture, except "mixtral": a llama file with experts.
ARCHS = {
    "llama": ArchSpec("LlamaForCausalLM", "llama", permuted_qk=True),
    "qwen2": ArchSpec("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ArchSpec("Qwen3ForCausalLM", "qwen3", {**_LAYER_NAMES, **_QK_NORMS}),
    "gemma3": ArchSpec("Gemma3ForCausalLM", "gemma3_text", {**_LAYER_NAMES, **_QK_NORMS, **_GEMMA_NORMS},
                       norm_shift=1.0),
    "mixtral": ArchSpec("MixtralForCausalLM", "mixtral", {**_ATTN_NAMES, **_MIXTRAL_MOE}, permuted_qk=True,
                        expert_names=_MIXTRAL_EXPERTS),
    "qwen2moe": ArchSpec("Qwen2MoeForCausalLM", "qwen2_moe", {**_ATTN_NAMES, **_QWEN_MOE, **_SHARED_EXPERT},
                         expert_names=_QWEN_EXPERTS),
    "qwen3moe": ArchSpec("Qwen3MoeForCausalLM", "qwen3_moe", {**_ATTN_NAMES, **_QWEN_MOE, **_QK_NORMS},
                         expert_names=_QWEN_EXPERTS),
    "olmoe": ArchSpec("OlmoeForCausalLM", "olmoe", {**_ATTN_NAMES, **_QWEN_MOE, **_QK_NORMS},
                      expert_names=_QWEN_EXPERTS),
}
SUPPORTED_ARCHITECTURES = tuple(a for a in ARCHS if a != "mixtral")

# blk.N.kind[.E].weight|bias; E: one expert of an old (split-expert) Mixtral file
_LAYER_RE = re.compile(r"blk\.([0-9]+)\.([a-z_]+)(?:\.([0-9]+))?\.(weight|bias)")  # ASCII digits only
# Present in some llama GGUFs but not an HF parameter: llama-3 rope frequency factors
# (HF derives them from rope_scaling) and the cached rotary table of old converters.
_SKIPPED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def architecture(gguf: GGUFFile) -> str:
    """The key of ``ARCHS`` for this file: its general.architecture, or "mixtral"."""
    md = gguf.metadata
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if arch == "llama" and md.get("llama.expert_count"):  # llama.cpp has no "mixtral" architecture
        return "mixtral"
    return arch


def hf_names(gguf_name: str, arch: str = "llama", num_experts: int = 0) -> list[tuple[str, Optional[int]]]:
    """The HF parameters one GGUF tensor holds, as (HF name, expert): ``expert`` indexes the
    leading dim of a stacked ``*_exps`` tensor (one name per expert), None means the whole
    tensor. Empty for tensors HF has no parameter for."""
    if gguf_name in _GLOBAL_NAMES:
        return [(_GLOBAL_NAMES[gguf_name], None)]
    if gguf_name in _SKIPPED or gguf_name.endswith(".attn_rot_embd"):
        return []
    spec = ARCHS[arch]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is not None:
        layer, kind, expert, suffix = m.groups()
        prefix = f"model.layers.{layer}."
        if expert is None and kind in spec.layer_names:
            return [(f"{prefix}{spec.layer_names[kind]}.{suffix}", None)]
        if expert is not None and kind in spec.expert_names:  # split experts: one tensor each
            return [(f"{prefix}{spec.expert_names[kind].format(e=expert)}.{suffix}", None)]
        if expert is None and kind.endswith("_exps") and kind[:-5] in spec.expert_names:
            template = f"{prefix}{spec.expert_names[kind[:-5]]}.{suffix}"
            return [(template.format(e=e), e) for e in range(num_experts)]
    raise CheckpointError(f"unknown {arch} GGUF tensor {gguf_name!r}")


def rope_heads(arch: str, cfg: dict[str, Any], gguf_name: str) -> Optional[int]:
    """Heads to un-permute the rows of this tensor by (llama q/k), else None."""
    kind = tensor_kind(gguf_name)
    if not ARCHS[arch].permuted_qk or kind not in ("attn_q", "attn_k"):
        return None
    return cfg["num_attention_heads"] if kind == "attn_q" else cfg["num_key_value_heads"]  # k: GQA


def raw_part(gguf: GGUFFile, gguf_name: str, expert: Optional[int]) -> tuple[np.ndarray, tuple[int, ...]]:
    """Stored bytes and numpy shape of one expert of a stacked tensor (experts are its
    leading dim, so each is one contiguous run of bytes), or of the whole tensor."""
    info, raw = gguf.tensors[gguf_name], gguf.raw(gguf_name)
    if expert is None:
        return raw, info.shape
    size = raw.size // info.shape[0]
    return raw[expert * size:(expert + 1) * size], info.shape[1:]


def hf_tensor(gguf: GGUFFile, cfg: dict[str, Any], gguf_name: str) -> Optional[tuple[str, np.ndarray]]:
    """(HF name, float32 values in HF layout) of a GGUF tensor that is one HF parameter (not
    a stacked expert tensor: see ``hf_tensors``); None if HF has no such parameter."""
    arch = architecture(gguf)
    names = hf_names(gguf_name, arch, num_experts(cfg))
    if not names:
        return None
    if names[0][1] is not None:
        raise CheckpointError(f"{gguf.path}: {gguf_name!r} holds {len(names)} experts, not one tensor")
    values = gguf.dequantize(gguf_name)
    heads = rope_heads(arch, cfg, gguf_name)
    if heads:
        values = unpermute_rope_rows(values, heads)
    if ARCHS[arch].norm_shift and gguf_name.endswith("norm.weight"):
        values = values - np.float32(ARCHS[arch].norm_shift)
    if tensor_kind(gguf_name) == ONE_ROW:
        values = values.reshape(1, -1)
    return names[0][0], values


def hf_tensors(gguf: GGUFFile, cfg: dict[str, Any], gguf_name: str) -> Iterator[tuple[str, np.ndarray]]:
    """Every (HF name, float32 values) in one GGUF tensor: none, one, or one per expert of a
    stacked tensor, dequantized one expert at a time."""
    for name, expert in hf_names(gguf_name, architecture(gguf), num_experts(cfg)):
        if expert is None:
            yield hf_tensor(gguf, cfg, gguf_name)
            continue
        raw, shape = raw_part(gguf, gguf_name, expert)
        try:
            yield name, dequantize(raw, gguf.tensors[gguf_name].type_id, shape)
        except CheckpointError as e:
            raise CheckpointError(f"{gguf.path}: tensor {gguf_name!r}: {e}") from None


def lazy_hf_tensors(gguf: GGUFFile, cfg: dict[str, Any], gguf_name: str) -> Iterator[tuple[str, Any]]:
    """Like ``hf_tensors`` but LazyTensors for 2-D weights (each expert its own): a
    tensor-parallel rank that narrows one dequantizes only its rows (GGUF rows are
    contiguous) and, at block boundaries, its columns."""
    import torch
    from tokenmill.layers.lazy import LazyTensor
    arch, info = architecture(gguf), gguf.tensors[gguf_name]
    for name, expert in hf_names(gguf_name, arch, num_experts(cfg)):
        if expert is not None:
            yield name, LazyTensor(_gguf_reader(gguf, cfg, gguf_name, None, expert), info.shape[1:], torch.float32)
        elif len(info.shape) != 2 or gguf_name.endswith("norm.weight"):
            converted = hf_tensor(gguf, cfg, gguf_name)
            yield converted[0], torch.from_numpy(converted[1])
        else:
            heads = rope_heads(arch, cfg, gguf_name)
            yield name, LazyTensor(_gguf_reader(gguf, cfg, gguf_name, heads), info.shape, torch.float32)


def _gguf_reader(gguf: GGUFFile, cfg: dict[str, Any], gguf_name: str, heads: Optional[int],
                 expert: Optional[int] = None):
    import torch
    from tokenmill.models.loader.gguf_quants import ggml_type
    info = gguf.tensors[gguf_name]
    whole, (rows, cols) = raw_part(gguf, gguf_name, expert)
    t = ggml_type(info.type_id)
    row_bytes = cols // t.block_size * t.type_size
    head_rows = rows // heads if heads else 1

    def read(ranges) -> torch.Tensor:
        (r0, nr), (c0, nc) = ranges
        if heads and (r0 % head_rows or nr % head_rows):   # un-permute needs whole heads
            return torch.from_numpy(hf_tensor(gguf, cfg, gguf_name)[1][r0:r0 + nr, c0:c0 + nc].copy())
        aligned = c0 % t.block_size == 0 and nc % t.block_size == 0
        b0, nb = (c0, nc) if aligned else (0, cols)
        raw = whole.reshape(rows, row_bytes)[r0:r0 + nr]
        raw = raw[:, b0 // t.block_size * t.type_size:(b0 + nb) // t.block_size * t.type_size]
        values = dequantize(raw.reshape(-1), info.type_id, (nr, nb))
        if not aligned:
            values = values[:, c0:c0 + nc]
        if heads:
            values = unpermute_rope_rows(values, nr // head_rows)
        return torch.from_numpy(np.ascontiguousarray(values))

    return read


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (works for a weight [rows, in] or a bias [rows]).

    HF rotates the two halves of each head (rotate_half); llama.cpp rotates adjacent pairs.
    Its converter therefore reorders each head's rows from (half, i) to (i, half): row
    ``h*d + 2*i + j`` of the GGUF tensor is row ``h*d + j*d/2 + i`` of the HF one. Reshape
    to (head, i, half) and swap back to (head, half, i).
    """
    rows = w.shape[0]
    if num_heads <= 0 or rows % (2 * num_heads):
        raise CheckpointError(f"cannot un-permute {rows} rows into {num_heads} heads of even size")
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (HF order -> GGUF order); the inverse of the above."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _get(md: dict[str, Any], key: str, path: str, kind: type = int, default: Any = ...) -> Any:
    value = md.get(key, default)
    if value is ...:
        raise CheckpointError(f"{path}: missing metadata {key!r}")
    if value is not None and (not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool)):
        # ints are fine where floats are asked for (e.g. an integer rope base)
        if not (kind is float and isinstance(value, int) and not isinstance(value, bool)):
            raise CheckpointError(f"{path}: metadata {key!r} = {value!r} is not {kind.__name__}")
    if kind is int and value is not None and value <= 0:
        raise CheckpointError(f"{path}: metadata {key!r} = {value!r} must be positive")
    return value


def hf_config(gguf: GGUFFile) -> dict[str, Any]:
    """An HF LlamaConfig-style dict from llama.* and tokenizer.* metadata."""
    md, path, arch = gguf.metadata, gguf.path, architecture(gguf)
    p = md["general.architecture"] + "."  # "llama." for mixtral
    hidden = _get(md, p + "embedding_length", path)
    num_heads = _get(md, p + "attention.head_count", path)
    num_kv_heads = _get(md, p + "attention.head_count_kv", path, default=num_heads)
    head_dim = _get(md, p + "attention.key_length", path, default=None) or hidden // num_heads
    rope_dims = md.get(p + "rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise CheckpointError(f"{path}: partial rotary ({rope_dims} of {head_dim} dims) is not supported")
    if num_heads % num_kv_heads:
        raise CheckpointError(f"{path}: {num_heads} heads is not a multiple of {num_kv_heads} KV heads")
    num_layers = _get(md, p + "block_count", path)
    if num_layers > len(gguf.tensors):  # checked before anything is sized by it
        raise CheckpointError(f"{path}: {len(gguf.tensors)} tensors cannot hold {num_layers} layers")
    spec = ARCHS[arch]
    cfg = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": _get(md, p + "feed_forward_length", path),
        "rms_norm_eps": _get(md, p + "attention.layer_norm_rms_epsilon", path, float, 1e-5),
        "rope_theta": float(_get(md, p + "rope.freq_base", path, float, 10000.0)),
        "rope_scaling": _rope_scaling(md, p, path),
        "vocab_size": _vocab_size(gguf, p),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "max_position_embeddings": _get(md, p + "context_length", path, default=2048),
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": md.get("tokenizer.ggml.padding_token_id"),
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in gguf.tensors,
        "hidden_act": "silu",
    }
    if arch == "gemma3":
        cfg.update(_gemma3_config(md, p, path, cfg))
    if ARCHS[arch].expert_names:
        cfg.update(_moe_config(md, p, path, cfg))
    return cfg


SOFTMAX_GATING = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


def _moe_config(md: dict[str, Any], p: str, path: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoE keys of the HF config; transformers' names differ per architecture."""
    experts, top_k = _get(md, p + "expert_count", path), _get(md, p + "expert_used_count", path)
    if top_k > experts:
        raise CheckpointError(f"{path}: {top_k} experts per token but only {experts} experts")
    if md.get(p + "expert_gating_func", SOFTMAX_GATING) != SOFTMAX_GATING:
        raise CheckpointError(f"{path}: expert gating {md[p + 'expert_gating_func']!r} is not supported (softmax only)")
    # Mixtral and OLMoE files give the expert size as feed_forward_length; Qwen files have a key for it.
    ffn = _get(md, p + "expert_feed_forward_length", path, default=None) or cfg["intermediate_size"]
    norm = _get(md, p + "expert_weights_norm", path, bool, default=None)
    kind = cfg["model_type"]
    if kind == "mixtral":
        return {"num_local_experts": experts, "num_experts_per_tok": top_k, "intermediate_size": ffn,
                "sliding_window": None}
    out = {"num_experts": experts, "num_experts_per_tok": top_k}
    if kind == "olmoe":
        return {**out, "intermediate_size": ffn, "norm_topk_prob": bool(norm),
                "clip_qkv": _get(md, p + "attention.clamp_kqv", path, float, default=None)}
    out.update({"moe_intermediate_size": _get(md, p + "expert_feed_forward_length", path),
                "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
                "sliding_window": None})
    if kind == "qwen3_moe":
        # transformers 5 saves Qwen3-MoE's count as num_local_experts, Hub configs as num_experts;
        # without the key llama.cpp renormalises qwen3moe's top-k weights
        return {**out, "num_local_experts": experts, "norm_topk_prob": True if norm is None else norm}
    # qwen2moe: llama.cpp falls back to feed_forward_length for the shared expert's size
    shared = _get(md, p + "expert_shared_feed_forward_length", path, default=None) or cfg["intermediate_size"]
    return {**out, "shared_expert_intermediate_size": shared, "norm_topk_prob": bool(norm)}


GEMMA3_SLIDING_PATTERN = 6  # every 6th layer is global; llama.cpp hard-codes this for gemma3
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # likewise the local layers' RoPE base


def _gemma3_config(md: dict[str, Any], p: str, path: str, cfg: dict[str, Any]) -> dict[str, Any]:
    window = _get(md, p + "attention.sliding_window", path)
    num_layers = cfg["num_hidden_layers"]
    return {
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": window, "sliding_window_pattern": GEMMA3_SLIDING_PATTERN,
        "layer_types": ["full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
                        for i in range(num_layers)],
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
        # llama.cpp scales queries by head_dim ** -0.5 (all sizes but 27B, which it rejects here)
        "query_pre_attn_scalar": cfg["head_dim"],
        "final_logit_softcapping": md.get(p + "final_logit_softcapping"),
        "attn_logit_softcapping": md.get(p + "attn_logit_softcapping"),
        "rms_norm_eps": _get(md, p + "attention.layer_norm_rms_epsilon", path, float, 1e-6),
    }


def _rope_scaling(md: dict[str, Any], p: str, path: str) -> Optional[dict[str, Any]]:
    kind = md.get(p + "rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(_get(md, p + "rope.scaling.factor", path, float))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = _get(md, p + "rope.scaling.original_context_length", path)
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise CheckpointError(f"{path}: unsupported rope scaling type {kind!r}")


def _vocab_size(gguf: GGUFFile, p: str) -> int:
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and tokens:
        return len(tokens)
    if p + "vocab_size" in gguf.metadata:
        return _get(gguf.metadata, p + "vocab_size", gguf.path)
    embd = gguf.tensors.get("token_embd.weight")
    if embd is None:
        raise CheckpointError(f"{gguf.path}: cannot tell the vocabulary size (no tokens, no token_embd.weight)")
    return embd.dims[-1]


_BY_MODEL_TYPE = {spec.model_type: spec for spec in ARCHS.values()}


def check_tensors(gguf: GGUFFile, cfg: dict[str, Any]) -> None:
    """``gguf_shapes.check_tensors`` with this module's naming: shapes follow the config's
    model_type, names the file's architecture (as they are loaded)."""
    arch = architecture(gguf)
    gguf_shapes.check_tensors(gguf, cfg, _BY_MODEL_TYPE[cfg["model_type"]],
                              lambda gguf_name, experts: hf_names(gguf_name, arch, experts))
