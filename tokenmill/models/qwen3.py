"""Qwen3: the Llama decoder with an RMSNorm over each head of q and k before RoPE."""
from __future__ import annotations

from dataclasses import replace

from tokenmill.models.llama import LlamaArgs, LlamaForCausalLM
from tokenmill.models.qwen2 import qwen_windows


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def make_args(cls, hf_config: dict) -> LlamaArgs:
        args = LlamaArgs.from_hf(hf_config)
        return replace(args, qk_norm=True, sliding_windows=qwen_windows(hf_config, args.num_hidden_layers))
