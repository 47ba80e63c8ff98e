"""Qwen2-MoE and Qwen3-MoE: the Qwen2 / Qwen3 decoders whose sparse layers route each token
to ``num_experts_per_tok`` of ``num_experts`` experts (renormalised when ``norm_topk_prob``).
Layers listed in ``mlp_only_layers``, or off the ``decoder_sparse_step`` grid, keep a dense
MLP. Qwen2-MoE adds a shared expert on every sparse layer, scaled by a sigmoid gate."""
from __future__ import annotations

from dataclasses import replace

from tokenmill.layers.moe import MoEArgs
from tokenmill.models.llama import LlamaArgs
from tokenmill.models.qwen2 import Qwen2ForCausalLM
from tokenmill.models.qwen3 import Qwen3ForCausalLM


def qwen_moe_args(hf_config: dict, num_layers: int, shared: bool) -> MoEArgs:
    experts = hf_config.get("num_experts") or hf_config.get("num_local_experts")
    step = hf_config.get("decoder_sparse_step") or 1
    dense = set(hf_config.get("mlp_only_layers") or ())
    return MoEArgs(
        num_experts=experts, top_k=hf_config["num_experts_per_tok"],
        expert_intermediate_size=hf_config["moe_intermediate_size"],
        renormalize=bool(hf_config.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=(hf_config.get("shared_expert_intermediate_size") or 0) if shared else 0,
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)))


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    @classmethod
    def make_args(cls, hf_config: dict) -> LlamaArgs:
        args = super().make_args(hf_config)
        return replace(args, moe=qwen_moe_args(hf_config, args.num_hidden_layers, shared=True))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @classmethod
    def make_args(cls, hf_config: dict) -> LlamaArgs:
        args = super().make_args(hf_config)
        return replace(args, moe=qwen_moe_args(hf_config, args.num_hidden_layers, shared=False))
