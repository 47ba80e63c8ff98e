"""Llama-family decoder (Llama 2/3, SmolLM2, ...). Math only: no scheduling, device or
quantization branches. Parameter names match HF checkpoints; q/k/v and gate/up are fused
into one matmul each, declared in ``stacked_params``.

Tensor parallel over ``tp``: each rank computes its attention heads (q/k/v column-split, KV
heads replicated when there are fewer than ranks) and its FFN columns; o_proj and down_proj
are row-split (one all-reduce each inside the layer); embedding and head split the vocabulary.

Mixture-of-Experts variants (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) set ``LlamaArgs.moe``: their
sparse layers hold a ``layers.moe.SparseMoE`` of the same gated MLPs in place of the dense one."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import nn

from tokenmill.distributed.parallel_state import SINGLE, TPGroup, split_evenly
from tokenmill.layers.activation import gated_activation
from tokenmill.layers.attention.base import AttentionBackend
from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.layers.linear import Linear, MergedLinear
from tokenmill.layers.moe import ExpertLoad, MoEArgs, SparseMoE
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.layers.vocab import VocabParallelEmbedding


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str = "silu"
    # Variants of the same decoder (Mistral, Qwen2, Qwen3) differ only in these knobs.
    qkv_bias: Optional[bool] = None     # None: follow attention_bias (Qwen2: q/k/v only)
    qk_norm: bool = False               # Qwen3: RMSNorm over each head of q and k
    sliding_windows: tuple = ()         # per layer: window size or None (full attention)
    qk_norm_over_projection: bool = False   # OLMoE: the q/k norms span all heads at once
    clip_qkv: Optional[float] = None    # OLMoE: q, k, v clamped to [-clip, clip]
    moe: Optional[MoEArgs] = None       # expert layers (None: a dense model)

    def window(self, layer: int) -> Optional[int]:
        return self.sliding_windows[layer] if self.sliding_windows else None

    @classmethod
    def from_hf(cls, cfg: dict) -> "LlamaArgs":
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters")   # transformers 5 spelling
        if isinstance(rope_params, dict):
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_scaling or rope_params
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=rope_theta or 10000.0,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu")


def layer_windows(cfg: dict, num_layers: int) -> tuple:
    """Per-layer sliding window from HF ``layer_types`` ("sliding_attention" layers use
    ``sliding_window``, the others full attention)."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if not window or not types:
        return ()
    if len(types) != num_layers:
        raise ValueError(f"layer_types lists {len(types)} layers, the model has {num_layers}")
    return tuple(window if t == "sliding_attention" else None for t in types)


class LlamaAttention(nn.Module):
    norm_cls = RMSNorm   # of the optional per-head q/k norms

    def __init__(self, a: LlamaArgs, rotary: RotaryEmbedding, sliding_window: Optional[int] = None,
                 scale: Optional[float] = None, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.head_dim = a.head_dim
        self.num_heads = split_evenly(a.num_attention_heads, tp.size, "attention heads")
        self.num_kv_heads, kv_parts = kv_heads_per_rank(a.num_key_value_heads, tp)
        q_size, kv_size = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
        qkv_bias = a.attention_bias if a.qkv_bias is None else a.qkv_bias
        self.qkv_proj = MergedLinear(a.hidden_size, [q_size, kv_size, kv_size], ["q", "k", "v"],
                                     bias=qkv_bias, tp=tp, parallel="column",
                                     shard_parts={"k": kv_parts, "v": kv_parts} if kv_parts else None)
        self.o_proj = Linear(q_size, a.hidden_size, bias=a.attention_bias, tp=tp, parallel="row")
        self.norm_over_projection = a.qk_norm_over_projection
        q_norm_size, k_norm_size = ((self.num_heads * a.head_dim, self.num_kv_heads * a.head_dim)
                                    if a.qk_norm_over_projection else (a.head_dim, a.head_dim))
        self.q_norm = self.norm_cls(q_norm_size, a.rms_norm_eps) if a.qk_norm else None
        self.k_norm = self.norm_cls(k_norm_size, a.rms_norm_eps) if a.qk_norm else None
        self.clip_qkv = a.clip_qkv
        self.rotary = rotary
        self.sliding_window = sliding_window
        self.scale = scale if scale is not None else self.head_dim ** -0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: tuple,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        # positions [T]; x [T, hidden]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        if self.norm_over_projection:   # OLMoE: before the split into heads
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.norm_over_projection:   # per head, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k, meta.plan_cache)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta.for_window(self.sliding_window),
                              self.scale, sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


def check_tensor_parallel(args: LlamaArgs, tp_size: int, expert_parallel: bool = False) -> None:
    """Fail before any rank starts when the heads, FFN features or experts do not split over
    ``tp_size`` ranks (the same rules the layers apply)."""
    if expert_parallel and args.moe is None:
        raise ValueError("expert parallelism needs a Mixture-of-Experts model; this one is dense")
    if tp_size == 1:
        return
    if args.qk_norm_over_projection:
        raise ValueError("tensor parallelism is not supported for models whose q/k norms span "
                         "all heads (OLMoE): each rank would normalise over its heads only")
    split_evenly(args.num_attention_heads, tp_size, "attention heads")
    kv_heads_per_rank(args.num_key_value_heads, TPGroup(0, tp_size, object()))
    moe = args.moe
    if moe is None or not all(moe.is_sparse(i) for i in range(args.num_hidden_layers)):
        split_evenly(args.intermediate_size, tp_size, "FFN features")
    if moe is not None:
        if expert_parallel:
            split_evenly(moe.num_experts, tp_size, "experts")
        else:
            split_evenly(moe.expert_intermediate_size, tp_size, "expert FFN features")
        if moe.shared_expert_intermediate_size:
            split_evenly(moe.shared_expert_intermediate_size, tp_size, "shared-expert FFN features")


def kv_heads_per_rank(num_kv_heads: int, tp: TPGroup) -> tuple[int, Optional[tuple[int, int]]]:
    """(KV heads this rank holds, (parts, this rank's part) when heads are replicated):
    with more ranks than KV heads each rank keeps one head, shared by tp / num_kv_heads
    consecutive ranks (their query heads are the ones that attend to it)."""
    if tp.size <= num_kv_heads:
        return split_evenly(num_kv_heads, tp.size, "KV heads"), None
    if tp.size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {tp.size} is neither a divisor nor a multiple "
                         f"of the {num_kv_heads} KV heads")
    return 1, (num_kv_heads, tp.rank // (tp.size // num_kv_heads))


class LlamaMLP(nn.Module):
    """``reduce=False``: a row-split down_proj leaves its partial sums to the caller (MoE
    experts, summed over experts first and reduced once)."""

    def __init__(self, a: LlamaArgs, tp: TPGroup = SINGLE, intermediate_size: Optional[int] = None,
                 reduce: bool = True) -> None:
        super().__init__()
        inter = intermediate_size or a.intermediate_size
        self.gate_up_proj = MergedLinear(a.hidden_size, [inter, inter], ["gate", "up"],
                                         bias=a.mlp_bias, tp=tp, parallel="column")
        self.down_proj = Linear(inter, a.hidden_size, bias=a.mlp_bias, tp=tp, parallel="row",
                                reduce_output=reduce)
        self.act = gated_activation(a.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [T, hidden]
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    ffn_name = "mlp"   # the FFN's module name in checkpoints (Mixtral: block_sparse_moe)

    def __init__(self, a: LlamaArgs, rotary: RotaryEmbedding, layer: int, tp: TPGroup = SINGLE,
                 expert_parallel: bool = False) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(a, rotary, sliding_window=a.window(layer), tp=tp)
        if a.moe is not None and a.moe.is_sparse(layer):
            ffn = SparseMoE(a.hidden_size, a.moe, lambda inter, mlp_tp, reduce: LlamaMLP(a, mlp_tp, inter, reduce),
                            tp, expert_parallel)
        else:
            ffn = LlamaMLP(a, tp)
        setattr(self, self.ffn_name, ffn)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, positions, x, kv_cache, meta, backend) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(x), kv_cache, meta, backend)
        normed, x = self.post_attention_layernorm.add_and_norm(attn, x)
        return x + self._modules[self.ffn_name](normed)


class LlamaModel(nn.Module):
    def __init__(self, a: LlamaArgs, tp: TPGroup = SINGLE, layer_cls: type = LlamaDecoderLayer,
                 expert_parallel: bool = False) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(a.vocab_size, a.hidden_size, tp)
        rotary = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope_theta, a.rope_scaling)
        self.layers = nn.ModuleList(layer_cls(a, rotary, i, tp, expert_parallel)
                                    for i in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (fused parameter fragment, shard id)
    stacked_params = {
        ".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"),
        ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", "gate"), ".up_proj.": (".gate_up_proj.", "up"),
    }

    decoder_layer_cls = LlamaDecoderLayer

    def __init__(self, hf_config: dict, tp: TPGroup = SINGLE, expert_parallel: bool = False) -> None:
        super().__init__()
        self.args = self.make_args(hf_config)
        check_tensor_parallel(self.args, tp.size, expert_parallel)
        self.tp = tp
        self.model = LlamaModel(self.args, tp, self.decoder_layer_cls, expert_parallel)
        self.lm_head = Linear(self.args.hidden_size, self.args.vocab_size, tp=tp,
                              parallel="column", gather_output=True)
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.moe_layers = [m for m in self.modules() if isinstance(m, SparseMoE)]
        # Tokens per expert, counted on every rank (the routing is replicated); None: dense.
        self.expert_load = ExpertLoad(len(self.moe_layers), self.args.moe.num_experts,
                                      tp.size if expert_parallel else None) if self.moe_layers else None
        for index, moe in enumerate(self.moe_layers):
            moe.load, moe.load_index = self.expert_load, index

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """Expert parallel: the tensors of experts another rank holds are not this rank's."""
        if not self.moe_layers or self.moe_layers[0].local is None:
            return False
        marker = ".experts."
        at = name.find(marker)
        if at < 0:
            return False
        expert = name[at + len(marker):].split(".", 1)[0]
        return expert.isdigit() and int(expert) not in self.moe_layers[0].local

    @classmethod
    def make_args(cls, hf_config: dict) -> LlamaArgs:
        """Config -> args; variants of this decoder override it to turn their knobs."""
        args = LlamaArgs.from_hf(hf_config)
        return replace(args, sliding_windows=layer_windows(hf_config, args.num_hidden_layers))

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank's cache holds."""
        return self.model.layers[0].self_attn.num_kv_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata, backend: AttentionBackend, aux=None) -> torch.Tensor:
        # input_ids [T], positions [T] -> hidden [T, hidden]. aux: a spec.draft_input.AuxCapture
        # that keeps the outputs of the layers a drafter reads.
        x = self.embed(input_ids)
        for index, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            x = layer(positions, x, kv_cache, meta, backend)
            if aux is not None:
                aux.offer(index, x)
        return self.model.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:   # [T] -> [T, hidden]
        """The decoder stack's input (the one-call decode stack starts from it too)."""
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:   # [N, hidden] -> [N, V]
        return self.lm_head(hidden).float()
