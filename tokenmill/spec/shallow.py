"""A weightless-to-train draft model: save the target's first N layers (+ embedding, final
norm, head) as a Llama checkpoint directory that ``draft_model`` can load. Same tokenizer by
construction. (layer_skip does the same without a copy; this exists so draft_model can be
tested and benchmarked on models that ship no small sibling.)"""
from __future__ import annotations

import json
import os

import torch


def save_shallow_copy(model, num_layers: int, path: str) -> str:
    """Write config.json + model.safetensors for the first ``num_layers`` layers of a
    tokenmill Llama-family model; fused projections are split back to checkpoint names."""
    from safetensors.torch import save_file
    from tokenmill.layers import prepacked
    a = model.args
    if not 1 <= num_layers <= a.num_hidden_layers:
        raise ValueError(f"num_layers must be in [1, {a.num_hidden_layers}], got {num_layers}")
    if any(prepacked.tiles_only(m) for m in model.modules()):
        raise ValueError("this model runs in bf16 mode, which keeps only bf16 tiles of its "
                         "weights: load it with cpu_gemm_dtype='float32' to save a copy")
    tensors = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= num_layers:
            continue
        if name == "lm_head.weight" and a.tie_word_embeddings:
            continue
        tensors.update(_unfused(model, name, param.detach().float().contiguous()))
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(llama_config(a, num_layers), f, indent=1)
    return path


def llama_config(a, num_layers: int) -> dict:
    """An HF Llama config.json for ``num_layers`` layers of a model with args ``a``."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": a.vocab_size, "hidden_size": a.hidden_size,
            "intermediate_size": a.intermediate_size, "num_hidden_layers": num_layers,
            "num_attention_heads": a.num_attention_heads,
            "num_key_value_heads": a.num_key_value_heads, "head_dim": a.head_dim,
            "rms_norm_eps": a.rms_norm_eps, "rope_theta": a.rope_theta,
            "rope_scaling": a.rope_scaling, "max_position_embeddings": a.max_position_embeddings,
            "tie_word_embeddings": a.tie_word_embeddings, "torch_dtype": "float32"}


def _unfused(model, name: str, tensor: torch.Tensor) -> dict:
    for fragment, (fused, _) in model.stacked_params.items():
        if fused in name:
            module = model.get_submodule(name.rsplit(".", 1)[0])
            parts = torch.split(tensor, module.shard_sizes, dim=0)
            out = {}
            for frag, (fz, shard) in model.stacked_params.items():
                if fz == fused:
                    out[name.replace(fused, frag)] = parts[module.shard_names.index(shard)].contiguous()
            return out
    return {name: tensor}
