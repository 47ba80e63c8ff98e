"""Write a Mixture-of-Experts HF model as a GGUF file the way llama.cpp's converter does.

``write_moe_gguf`` saves (or reads) the model's safetensors, maps each name with the
``gguf`` package's own TensorNameMap (the converter's table), stacks each layer's experts
into one ``ffn_*_exps`` tensor [experts, rows, cols] (or, ``split_experts``, writes the
per-expert ``ffn_gate.E`` tensors of old Mixtral files), permutes llama-arch q/k rows into
llama.cpp's RoPE order and stores everything F32 except the experts when ``quant`` names
a type. It returns what a loader must yield: HF name -> float32 array in HF layout.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from typing import Optional, Union

import numpy as np

from tokenmill.models.loader.gguf_llama import permute_rope_rows

ARCHS = {"mixtral": "LLAMA", "qwen2moe": "QWEN2MOE", "qwen3moe": "QWEN3MOE", "olmoe": "OLMOE"}
_EXPERT_RE = re.compile(r"(model\.layers\.\d+\..+\.experts)\.(\d+)\.(\w+)\.weight")
_SPLIT_KINDS = {"w1": "ffn_gate", "w3": "ffn_up", "w2": "ffn_down"}  # old Mixtral files


def write_moe_gguf(hf_model_or_dir, path: str, arch: str, quant: Optional[str] = None,
                   split_experts: bool = False) -> dict[str, np.ndarray]:
    """hf_model_or_dir: a transformers MoE model or the directory it was saved to; arch:
    "mixtral" | "qwen2moe" | "qwen3moe" | "olmoe"; quant: a gguf type name ("Q8_0",
    "Q4_0", ...) for the expert tensors, None for F32. Returns the expected HF tensors."""
    import gguf
    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r} is not one of {sorted(ARCHS)}")
    cfg, weights = _read_hf(hf_model_or_dir)
    _check_representable(cfg, arch)
    model_arch = getattr(gguf.MODEL_ARCH, ARCHS[arch])
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[model_arch])
    _write_metadata(writer, cfg, arch)
    name_map = gguf.get_tensor_name_map(model_arch, cfg["num_hidden_layers"])
    qtype = gguf.GGMLQuantizationType[quant] if quant else None
    expected = {}
    for gguf_name, hf_names, values, routed in _gguf_tensors(weights, cfg, arch, name_map, split_experts):
        if qtype is None or not routed:
            writer.add_tensor(gguf_name, values)
            expected.update((n, weights[n]) for n in hf_names)
            continue
        stored = gguf.quants.quantize(values, qtype)
        writer.add_tensor(gguf_name, stored, raw_dtype=qtype)
        back = gguf.quants.dequantize(stored, qtype).reshape(values.shape)
        expected.update(zip(hf_names, back if values.ndim == 3 else [back]))  # stacked: one per expert
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _read_hf(hf_model_or_dir: Union[str, os.PathLike, object]) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json dict, float32 numpy tensors) as transformers saves them (per-expert names)."""
    from safetensors.numpy import load_file
    if not isinstance(hf_model_or_dir, (str, os.PathLike)):
        with tempfile.TemporaryDirectory() as tmp:
            hf_model_or_dir.save_pretrained(tmp, safe_serialization=True)
            return _read_hf(tmp)
    directory = str(hf_model_or_dir)
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    weights = {}
    for file in sorted(os.listdir(directory)):
        if file.endswith(".safetensors"):
            weights.update({k: v.astype(np.float32) for k, v in load_file(os.path.join(directory, file)).items()})
    return cfg, weights


def _num_experts(cfg: dict) -> int:
    return cfg.get("num_local_experts") or cfg["num_experts"]


def _head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def _check_representable(cfg: dict, arch: str) -> None:
    """Settings llama.cpp's architectures cannot express: refuse rather than write a file
    that runs a different model."""
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError("GGUF MoE architectures have no dense layers (mlp_only_layers / decoder_sparse_step)")
    if arch == "mixtral" and cfg.get("sliding_window") is not None:
        raise ValueError("llama.cpp's llama architecture has no sliding window")
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{arch}: sliding-window attention is not expressible in GGUF")
    if (cfg.get("rope_parameters") or {}).get("rope_type", "default") != "default":
        raise ValueError("only default RoPE is written")


def _write_metadata(w, cfg: dict, arch: str) -> None:
    rope = cfg.get("rope_parameters") or {}
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(_head_dim(cfg))
    if _head_dim(cfg) != cfg["hidden_size"] // cfg["num_attention_heads"]:
        w.add_key_length(_head_dim(cfg))
        w.add_value_length(_head_dim(cfg))
    w.add_expert_count(_num_experts(cfg))
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if arch != "mixtral":  # llama.cpp's newer key; our loader defaults match the converters
        w.add_expert_weights_norm(bool(cfg.get("norm_topk_prob", False)))
    if arch == "olmoe" and cfg.get("clip_qkv") is not None:
        w.add_clamp_kqv(float(cfg["clip_qkv"]))
    _write_tokenizer(w, cfg)


def _write_tokenizer(w, cfg: dict) -> None:
    """A byte-level BPE vocabulary of exactly vocab_size tokens: three control tokens, then
    single bytes (printable ASCII first), one merge, and fillers if the vocabulary is large."""
    from tokenmill.models.loader.gguf_tokenizer import byte_alphabet
    size, alphabet = cfg["vocab_size"], byte_alphabet()
    order = [*range(32, 127), *(b for b in range(256) if not 32 <= b < 127)]
    tokens = ["<pad>", "<s>", "</s>"] + [alphabet[b] for b in order][:size - 4] + [alphabet[32] + "t"]
    tokens += [f"<unused{i}>" for i in range(size - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (size - 3))
    w.add_token_merges([f"{alphabet[32]} t"])
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("pad_token_id", w.add_pad_token_id)):
        if isinstance(cfg.get(key), int) and 0 <= cfg[key] < size:
            add(cfg[key])


def _gguf_tensors(weights: dict, cfg: dict, arch: str, name_map, split_experts: bool):
    """(GGUF name, the HF names it holds, values in GGUF numpy layout, holds routed experts)."""
    stacks: dict[str, dict[int, str]] = {}
    for hf_name, values in weights.items():
        m = _EXPERT_RE.fullmatch(hf_name)
        if m is None:
            if arch == "mixtral" and re.search(r"self_attn\.[qk]_proj\.weight$", hf_name):
                heads = cfg["num_attention_heads"] if ".q_proj." in hf_name else cfg["num_key_value_heads"]
                values = permute_rope_rows(values, heads)
            yield _gguf_name(name_map, hf_name, (".weight", ".bias")), [hf_name], values, False
        elif split_experts and arch == "mixtral":
            layer = hf_name.split(".")[2]
            yield f"blk.{layer}.{_SPLIT_KINDS[m.group(3)]}.{m.group(2)}.weight", [hf_name], values, True
        else:
            stacks.setdefault(f"{m.group(1)}.{m.group(3)}.weight", {})[int(m.group(2))] = hf_name
    for merged, by_expert in stacks.items():  # the converter's torch.stack over experts
        names = [by_expert[e] for e in range(_num_experts(cfg))]
        yield _gguf_name(name_map, merged, (".weight",)), names, np.stack([weights[n] for n in names]), True


def _gguf_name(name_map, hf_name: str, suffixes: tuple[str, ...]) -> str:
    name = name_map.get_name(hf_name, try_suffixes=suffixes)
    if name is None:
        raise ValueError(f"llama.cpp has no GGUF name for {hf_name!r}")
    return name
