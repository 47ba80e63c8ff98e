"""Mixtral: the Mistral decoder with a sparse MoE block (top-k softmax, renormalised) in
place of every dense MLP. Checkpoints name it ``block_sparse_moe`` and the expert linears
w1 (gate), w3 (up), w2 (down)."""
from __future__ import annotations

from dataclasses import replace

from tokenmill.layers.moe import MoEArgs
from tokenmill.models.llama import LlamaArgs, LlamaDecoderLayer, LlamaForCausalLM
from tokenmill.models.mistral import MistralForCausalLM


class MixtralDecoderLayer(LlamaDecoderLayer):
    ffn_name = "block_sparse_moe"


class MixtralForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = MixtralDecoderLayer
    stacked_params = {   # no dense MLP: gate/up/down names are the experts'
        **{k: v for k, v in LlamaForCausalLM.stacked_params.items() if v[0] == ".qkv_proj."},
        ".w1.": (".gate_up_proj.", "gate"), ".w3.": (".gate_up_proj.", "up"),
        ".w2.": (".down_proj.", None),   # a rename: the whole tensor
    }

    @classmethod
    def make_args(cls, hf_config: dict) -> LlamaArgs:
        args = MistralForCausalLM.make_args(hf_config)
        moe = MoEArgs(num_experts=hf_config["num_local_experts"], top_k=hf_config["num_experts_per_tok"],
                      expert_intermediate_size=args.intermediate_size, renormalize=True)
        return replace(args, moe=moe)
