"""GGUF (llama.cpp) conventions -> Hugging Face conventions, for the llama-like
architectures (llama, qwen2, qwen3, gemma3).

Translations: metadata keys -> an HF ``config.json`` dict, tensor names -> HF parameter
names, q/k weights back from llama.cpp's RoPE row order to HF's (llama only), and Gemma's
norm weights back from llama.cpp's ``1 + w`` to HF's ``w``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from .errors import CheckpointError
from .gguf_reader import GGUFFile


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma's converter renames the sandwich norms: its ffn_norm is HF's pre-feedforward norm.
_GEMMA_NORMS = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}


@dataclass(frozen=True)
class ArchSpec:
    """How one llama.cpp architecture maps onto an HF one."""
    hf_architecture: str
    model_type: str
    layer_names: dict = field(default_factory=lambda: dict(_LAYER_NAMES))
    permuted_qk: bool = False  # llama.cpp's converter reorders q/k rows (llama only)
    norm_shift: float = 0.0  # the converter stored norm weights + this (Gemma: 1)


ARCHS = {
    "llama": ArchSpec("LlamaForCausalLM", "llama", permuted_qk=True),
    "qwen2": ArchSpec("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ArchSpec("Qwen3ForCausalLM", "qwen3", {**_LAYER_NAMES, **_QK_NORMS}),
    "gemma3": ArchSpec("Gemma3ForCausalLM", "gemma3_text", {**_LAYER_NAMES, **_QK_NORMS, **_GEMMA_NORMS},
                       norm_shift=1.0),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHS)

_LAYER_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
# Present in some llama GGUFs but not an HF parameter: llama-3 rope frequency factors
# (HF derives them from rope_scaling) and the cached rotary table of old converters.
_SKIPPED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def architecture(gguf: GGUFFile) -> str:
    arch = gguf.metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return arch


def hf_name(gguf_name: str, arch: str = "llama") -> Optional[str]:
    """HF parameter name for a GGUF tensor name, None for tensors HF has no parameter for."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name in _SKIPPED or gguf_name.endswith(".attn_rot_embd"):
        return None
    names = ARCHS[arch].layer_names
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in names:
        raise CheckpointError(f"unknown {arch} GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


def hf_tensor(gguf: GGUFFile, cfg: dict[str, Any], gguf_name: str) -> Optional[tuple[str, np.ndarray]]:
    """(HF name, float32 values in HF layout) of one GGUF tensor; None if HF has no such parameter."""
    arch = architecture(gguf)
    name = hf_name(gguf_name, arch)
    if name is None:
        return None
    values = gguf.dequantize(gguf_name)
    spec = ARCHS[arch]
    kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
    if spec.permuted_qk and kind in ("attn_q", "attn_k"):
        # k uses the KV head count (GQA)
        heads = cfg["num_attention_heads"] if kind == "attn_q" else cfg["num_key_value_heads"]
        values = unpermute_rope_rows(values, heads)
    if spec.norm_shift and gguf_name.endswith("norm.weight"):
        values = values - np.float32(spec.norm_shift)
    return name, values


def lazy_hf_tensor(gguf: GGUFFile, cfg: dict[str, Any], gguf_name: str):
    """Like ``hf_tensor`` but a LazyTensor for 2-D weights: a tensor-parallel rank that
    narrows it dequantizes only its rows (GGUF rows are contiguous) and, at block
    boundaries, its columns. None if HF has no such parameter."""
    import torch
    from tokenmill.layers.lazy import LazyTensor
    info = gguf.tensors[gguf_name]
    name = hf_name(gguf_name, architecture(gguf))
    if name is None or len(info.shape) != 2 or gguf_name.endswith("norm.weight"):
        converted = hf_tensor(gguf, cfg, gguf_name)
        return None if converted is None else (converted[0], torch.from_numpy(converted[1]))
    kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
    heads = None
    if ARCHS[architecture(gguf)].permuted_qk and kind in ("attn_q", "attn_k"):
        heads = cfg["num_attention_heads"] if kind == "attn_q" else cfg["num_key_value_heads"]
    return name, LazyTensor(_gguf_reader(gguf, cfg, gguf_name, heads), info.shape, torch.float32)


def _gguf_reader(gguf: GGUFFile, cfg: dict[str, Any], gguf_name: str, heads: Optional[int]):
    import torch
    from tokenmill.models.loader.gguf_quants import dequantize, ggml_type
    info = gguf.tensors[gguf_name]
    rows, cols = info.shape
    t = ggml_type(info.type_id)
    row_bytes = cols // t.block_size * t.type_size
    head_rows = rows // heads if heads else 1

    def read(ranges) -> torch.Tensor:
        (r0, nr), (c0, nc) = ranges
        if heads and (r0 % head_rows or nr % head_rows):   # un-permute needs whole heads
            return torch.from_numpy(hf_tensor(gguf, cfg, gguf_name)[1][r0:r0 + nr, c0:c0 + nc].copy())
        aligned = c0 % t.block_size == 0 and nc % t.block_size == 0
        b0, nb = (c0, nc) if aligned else (0, cols)
        raw = gguf.raw(gguf_name).reshape(rows, row_bytes)[r0:r0 + nr]
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
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        # ints are fine where floats are asked for (e.g. an integer rope base)
        if not (kind is float and isinstance(value, int) and not isinstance(value, bool)):
            raise CheckpointError(f"{path}: metadata {key!r} = {value!r} is not {kind.__name__}")
    if kind is int and value is not None and value <= 0:
        raise CheckpointError(f"{path}: metadata {key!r} = {value!r} must be positive")
    return value


def hf_config(gguf: GGUFFile) -> dict[str, Any]:
    """An HF LlamaConfig-style dict from llama.* and tokenizer.* metadata."""
    md, path, arch = gguf.metadata, gguf.path, architecture(gguf)
    p = f"{arch}."
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
    return cfg


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


def _expected_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF name -> shape (numpy order) of every weight a llama with this config must have."""
    hidden, vocab, ffn = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    q_rows = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_rows = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    per_layer = _per_layer_shapes(cfg)
    for i in range(cfg["num_hidden_layers"]):
        for module, shape in per_layer.items():
            shapes[f"model.layers.{i}.{module}.weight"] = shape
    return shapes


def _per_layer_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF module -> weight shape, for one layer of this config's architecture."""
    hidden, ffn, head_dim = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q_rows, kv_rows = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {"self_attn.q_proj": (q_rows, hidden), "self_attn.k_proj": (kv_rows, hidden),
              "self_attn.v_proj": (kv_rows, hidden), "self_attn.o_proj": (hidden, q_rows),
              "mlp.gate_proj": (ffn, hidden), "mlp.up_proj": (ffn, hidden), "mlp.down_proj": (hidden, ffn),
              "input_layernorm": (hidden,), "post_attention_layernorm": (hidden,)}
    if cfg["model_type"] in ("qwen3", "gemma3_text"):
        shapes.update({"self_attn.q_norm": (head_dim,), "self_attn.k_norm": (head_dim,)})
    if cfg["model_type"] == "gemma3_text":
        shapes.update({"pre_feedforward_layernorm": (hidden,), "post_feedforward_layernorm": (hidden,)})
    return shapes


def check_tensors(gguf: GGUFFile, cfg: dict[str, Any]) -> None:
    """Every weight the config implies is present with the right shape, nothing unexpected.

    Done at open time so a lying config (say a billion layers) fails before any model is built.
    """
    num_layers, arch = cfg["num_hidden_layers"], architecture(gguf)
    if num_layers * len(_per_layer_shapes(cfg)) > len(gguf.tensors):  # a lying count, not a model
        raise CheckpointError(f"{gguf.path}: {len(gguf.tensors)} tensors cannot hold {num_layers} layers")
    expected = _expected_shapes(cfg)
    found = {}
    for gguf_name, info in gguf.tensors.items():
        name = hf_name(gguf_name, arch)
        if name is None:
            continue
        if name.endswith(".bias"):  # biases follow their weight's output rows
            weight = expected.get(name[:-5] + ".weight")
            if weight is None or info.shape != weight[:1]:
                raise CheckpointError(f"{gguf.path}: unexpected bias {gguf_name!r} with shape {info.shape}")
            continue
        if name not in expected:
            raise CheckpointError(f"{gguf.path}: tensor {gguf_name!r} does not fit the config "
                                  f"({cfg['num_hidden_layers']} layers, tied={cfg['tie_word_embeddings']})")
        if info.shape != expected[name]:
            raise CheckpointError(f"{gguf.path}: tensor {gguf_name!r} has shape {info.shape}, expected {expected[name]}")
        found[name] = gguf_name
    missing = sorted(set(expected) - set(found), key=lambda n: (len(n), n))
    if missing:
        raise CheckpointError(f"{gguf.path}: missing tensors: {', '.join(missing[:5])}")
