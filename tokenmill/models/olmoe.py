"""OLMoE: a Llama decoder whose q/k norms span the whole projection (all heads at once),
with optional q/k/v clipping, and a sparse MoE block (renormalised when ``norm_topk_prob``)
on every layer; experts are ``intermediate_size`` wide."""
from __future__ import annotations

from dataclasses import replace

from tokenmill.layers.moe import MoEArgs
from tokenmill.models.llama import LlamaArgs, LlamaForCausalLM


class OlmoeForCausalLM(LlamaForCausalLM):
    @classmethod
    def make_args(cls, hf_config: dict) -> LlamaArgs:
        args = super().make_args(hf_config)
        moe = MoEArgs(num_experts=hf_config["num_experts"], top_k=hf_config["num_experts_per_tok"],
                      expert_intermediate_size=args.intermediate_size,
                      renormalize=bool(hf_config.get("norm_topk_prob", False)))
        return replace(args, qk_norm=True, qk_norm_over_projection=True,
                       clip_qkv=hf_config.get("clip_qkv"), moe=moe)
