"""Gemma 3 (text) decoder. Math only; names match HF ``Gemma3ForCausalLM`` checkpoints.

Differences from Llama, all declared here rather than branched on elsewhere:
- embeddings are multiplied by sqrt(hidden_size); the (tied) head uses them unscaled;
- every RMSNorm is Gemma's ``x * (1 + w)``; q and k get a per-head norm before RoPE;
- each layer normalises around attention *and* MLP outputs too (four norms per layer);
- sliding-window ("local") layers and full ("global") layers alternate, each kind with its
  own RoPE base (and scaling, for global layers);
- attention scale is ``query_pre_attn_scalar ** -0.5``; the MLP uses gelu-tanh;
- optional final logit soft-capping.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from tokenmill.distributed.parallel_state import SINGLE, TPGroup
from tokenmill.layers.attention.base import AttentionBackend
from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import GemmaRMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.layers.vocab import VocabParallelEmbedding
from tokenmill.models.llama import LlamaArgs, LlamaAttention, LlamaForCausalLM, LlamaMLP, layer_windows

DEFAULT_GLOBAL_THETA, DEFAULT_LOCAL_THETA = 1_000_000.0, 10_000.0


@dataclass(frozen=True)
class Gemma3Args(LlamaArgs):
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: Optional[float] = None
    local_rope_theta: float = DEFAULT_LOCAL_THETA
    local_rope_scaling: Optional[dict] = None

    @classmethod
    def from_gemma(cls, cfg: dict) -> "Gemma3Args":
        if cfg.get("attn_logit_softcapping") is not None:
            raise ValueError("Gemma attention logit soft-capping is not supported by the attention backends")
        base = LlamaArgs.from_hf(cfg)
        (theta, scaling), (local_theta, local_scaling) = _rope(cfg)
        fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
        fields.update(
            rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta,
            local_rope_scaling=local_scaling, qk_norm=True,
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            sliding_windows=_windows(cfg, base.num_hidden_layers))
        return cls(**fields)


def _rope(cfg: dict) -> tuple[tuple[float, Optional[dict]], tuple[float, Optional[dict]]]:
    """((global theta, scaling), (local theta, scaling)) from transformers-5 per-layer-type
    ``rope_parameters`` or the older rope_theta / rope_local_base_freq / rope_scaling keys."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        out = []
        for kind, default in (("full_attention", DEFAULT_GLOBAL_THETA), ("sliding_attention", DEFAULT_LOCAL_THETA)):
            p = params.get(kind) or {}
            scaling = p if p.get("rope_type", "default") != "default" else None
            out.append((float(p.get("rope_theta", default)), scaling))
        return out[0], out[1]
    theta = float(cfg.get("rope_theta") or DEFAULT_GLOBAL_THETA)
    return (theta, cfg.get("rope_scaling")), (float(cfg.get("rope_local_base_freq") or DEFAULT_LOCAL_THETA), None)


def _windows(cfg: dict, num_layers: int) -> tuple:
    """Every ``sliding_window_pattern``-th layer (1-based) is global, the rest slide."""
    windows = layer_windows(cfg, num_layers)
    if windows or cfg.get("layer_types") or not cfg.get("sliding_window"):
        return windows
    pattern = cfg.get("sliding_window_pattern") or 6
    return tuple(cfg["sliding_window"] if (i + 1) % pattern else None for i in range(num_layers))


class Gemma3Attention(LlamaAttention):
    norm_cls = GemmaRMSNorm


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, a: Gemma3Args, rotary: RotaryEmbedding, layer: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(a, rotary, sliding_window=a.window(layer),
                                         scale=a.query_pre_attn_scalar ** -0.5, tp=tp)
        self.mlp = LlamaMLP(a, tp)
        h, eps = a.hidden_size, a.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions, x, kv_cache, meta, backend) -> torch.Tensor:   # x [T, hidden]
        attn = self.self_attn(positions, self.input_layernorm(x), kv_cache, meta, backend)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    def __init__(self, a: Gemma3Args, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(a.vocab_size, a.hidden_size, tp)
        # HF keeps sqrt(hidden) as a float32 tensor and casts it to the weight dtype.
        self.register_buffer("embed_scale", torch.tensor(a.hidden_size ** 0.5), persistent=False)
        glob = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope_theta, a.rope_scaling)
        local = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.local_rope_theta, a.local_rope_scaling)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(a, local if a.window(i) else glob, i, tp) for i in range(a.num_hidden_layers))
        self.norm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps)


class Gemma3ForCausalLM(nn.Module):
    stacked_params = LlamaForCausalLM.stacked_params

    num_kv_heads = LlamaForCausalLM.num_kv_heads

    @classmethod
    def make_args(cls, hf_config: dict) -> Gemma3Args:
        return Gemma3Args.from_gemma(hf_config)

    def __init__(self, hf_config: dict, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.args = self.make_args(hf_config)
        self.tp = tp
        self.model = Gemma3Model(self.args, tp)
        self.lm_head = Linear(self.args.hidden_size, self.args.vocab_size, tp=tp,
                              parallel="column", gather_output=True)
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata, backend: AttentionBackend, aux=None) -> torch.Tensor:
        # input_ids [T], positions [T] -> hidden [T, hidden]; aux as in LlamaForCausalLM
        x = self.embed(input_ids)
        for index, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            x = layer(positions, x, kv_cache, meta, backend)
            if aux is not None:
                aux.offer(index, x)
        return self.model.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:   # [T] -> [T, hidden]
        """Embeddings times sqrt(hidden): the decoder stack's input (the one-call decode
        stack starts from it too)."""
        x = self.model.embed_tokens(input_ids)
        return x * self.model.embed_scale.to(x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:   # [N, hidden] -> [N, V]
        logits = self.lm_head(hidden).float()
        cap = self.args.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits
