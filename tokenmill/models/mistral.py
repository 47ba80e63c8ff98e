"""Mistral: the Llama decoder with sliding-window attention on every layer."""
from __future__ import annotations

from dataclasses import replace

from tokenmill.models.llama import LlamaArgs, LlamaForCausalLM, layer_windows


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def make_args(cls, hf_config: dict) -> LlamaArgs:
        args = LlamaArgs.from_hf(hf_config)
        window = hf_config.get("sliding_window")
        # HF Mistral applies ``sliding_window`` (when set) to all layers; a config that
        # lists layer_types (Ministral-style) says per layer.
        windows = layer_windows(hf_config, args.num_hidden_layers) or (
            (window,) * args.num_hidden_layers if window else ())
        return replace(args, sliding_windows=windows)
