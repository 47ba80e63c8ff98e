"""Qwen2: the Llama decoder with biases on q/k/v (not on o_proj) and optional sliding
windows on the layers from ``max_window_layers`` on."""
from __future__ import annotations

from dataclasses import replace

from tokenmill.models.llama import LlamaArgs, LlamaForCausalLM, layer_windows


def qwen_windows(hf_config: dict, num_layers: int) -> tuple:
    """layer_types when the config lists them; else HF's rule: with use_sliding_window,
    layers >= max_window_layers slide."""
    windows = layer_windows(hf_config, num_layers)
    if windows or hf_config.get("layer_types") or not hf_config.get("use_sliding_window"):
        return windows
    window, first = hf_config.get("sliding_window"), hf_config.get("max_window_layers", num_layers)
    return tuple(window if i >= first else None for i in range(num_layers)) if window else ()


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def make_args(cls, hf_config: dict) -> LlamaArgs:
        args = LlamaArgs.from_hf(hf_config)
        return replace(args, qkv_bias=True, attention_bias=False,
                       sliding_windows=qwen_windows(hf_config, args.num_hidden_layers))
