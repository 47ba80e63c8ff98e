"""DFlash drafter math (z-lab, "DFlash: Block Diffusion for Flash Speculative Decoding").

One forward drafts a whole block. Its input is the block [newest token, MASK, ..., MASK] at
positions b..b+bs-1 (b: the newest token's position); its outputs at block rows 1..bs-1, through
the target's LM head, are bs-1 draft tokens (row j guesses the token at b + j).

The layers are Qwen3-style decoder layers (per-head q/k RMSNorm, SwiGLU MLP) whose attention
keys and values are [context ; block]:
- context: the target's features at the verified positions p < b (the outputs of the decoder
  layers ``target_layer_ids``, concatenated), projected by ``fc`` + ``hidden_norm`` to one
  hidden row per position, then by each layer's own k_proj (+ k_norm, RoPE at p) and v_proj.
  The newest token has no feature yet: the target computes it when it verifies the block.
- block: the layer's own K/V of the block rows.
There is no causal mask: the block sees all its context and itself in both directions (every
MASK row reads the others; that is the diffusion part). Embeddings and LM head are the target's.

Module names follow z-lab's checkpoints (fc, hidden_norm, norm, layers.i.self_attn.q_proj ...),
so ``state_dict()`` is the checkpoint. Parameters are plain (trainable) torch modules: the
same module drafts in the engine and trains in tokenmill.spec.train.dflash_recipe.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.spec.trainable import Linear, LinearGroup, RMSNorm, Rotary, SwiGLU, init_weights, rotate

__all__ = ["DFlashConfig", "DFlashDrafter", "init_weights", "spread_layer_ids"]


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int                 # = the target's (its embeddings in, its LM head out)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    target_layer_ids: tuple          # decoder layers read as context (same ids as z-lab's)
    mask_token_id: int               # the block's MASK rows embed this token
    block_size: int = 16             # block rows: the newest token + block_size - 1 drafts
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: Optional[dict] = None
    attention_bias: bool = False
    input_embedding_scale: float = 1.0
    num_target_layers: int = 0       # the target's depth (written to checkpoints; 0: unknown)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(x) for x in self.target_layer_ids))
        if self.block_size < 2:
            raise ValueError(f"dflash block_size must be >= 2 (one token + drafts), "
                             f"got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("dflash needs at least one target layer id")
        if self.num_layers < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"dflash: {self.num_layers} layers, {self.num_heads} heads over "
                             f"{self.num_kv_heads} kv heads is not a valid shape")
        if self.head_dim % 2:
            raise ValueError(f"dflash head_dim must be even (RoPE), got {self.head_dim}")


def spread_layer_ids(num_target_layers: int, count: int) -> tuple:
    """``count`` target layers spread evenly from layer 1 to layer L - 3 (z-lab's default:
    middle-to-late features, not the embeddings or the very last layers), duplicates merged
    (small targets)."""
    if count == 1:
        return (num_target_layers // 2,)
    start = min(1, num_target_layers - 1)
    end = max(num_target_layers - 3, start)
    return tuple(sorted({round(start + i * (end - start) / (count - 1)) for i in range(count)}))


class DFlashAttention(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_proj = Linear(c.hidden_size, q_size, bias=c.attention_bias)
        self.k_proj = Linear(c.hidden_size, kv_size, bias=c.attention_bias)
        self.v_proj = Linear(c.hidden_size, kv_size, bias=c.attention_bias)
        self.o_proj = Linear(q_size, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.qkv_proj = LinearGroup(self.q_proj, self.k_proj, self.v_proj)
        self.kv_proj = LinearGroup(self.k_proj, self.v_proj)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., T, hidden] -> K (normed, rotated), V: [..., T, kv_heads, D]. The context rows
        (fc output) and the block rows (after input_layernorm) share these projections."""
        return self._kv(*self.kv_proj(x).split(self.kv_proj.sizes, dim=-1), cos, sin)

    def _kv(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        k = self.k_norm(k.unflatten(-1, (self.num_kv_heads, self.head_dim)))
        return rotate(k, cos, sin), v.unflatten(-1, (self.num_kv_heads, self.head_dim))

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask=None) -> torch.Tensor:
        # x [R, Q, hidden]; cos, sin [R, Q, D]; ctx_k, ctx_v [R, C, kv_heads, D];
        # mask None (all visible) or [R, Q, C + Q] bool, True = may attend
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.sizes, dim=-1)
        q = rotate(self.q_norm(q.unflatten(-1, (self.num_heads, self.head_dim))), cos, sin)
        k, v = self._kv(k, v, cos, sin)
        k = torch.cat([ctx_k.to(k.dtype), k], dim=1)
        v = torch.cat([ctx_v.to(v.dtype), v], dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=None if mask is None else mask.unsqueeze(1),
            enable_gqa=self.num_heads != self.num_kv_heads)                 # [R, heads, Q, D]
        return self.o_proj(out.transpose(1, 2).flatten(2))


class DFlashLayer(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(c)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        c = self.config = config
        self.fc = Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = Rotary(c.head_dim, c.rope_theta, c.rope_scaling)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def param_dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def context_kv(self, aux: torch.Tensor, positions: torch.Tensor) -> list:
        """aux [..., C, len(target_layer_ids) * hidden] at ``positions`` [..., C] -> per layer
        (K, V) [..., C, kv_heads, D]. Row p depends only on the target's feature at p."""
        ctx = self.hidden_norm(self.fc(aux.to(self.param_dtype)))
        cos, sin = self.rotary.cos_sin(positions, ctx.dtype)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def block_input(self, embed_tokens: nn.Module, first_ids: torch.Tensor) -> torch.Tensor:
        """first_ids [R] (each block's verified first token) -> [R, block_size, hidden]: the
        target's embeddings of [first, MASK, ..., MASK]."""
        ids = first_ids.new_full((first_ids.shape[0], self.block_size), self.config.mask_token_id)
        ids[:, 0] = first_ids
        x = embed_tokens(ids).to(self.param_dtype)
        scale = self.config.input_embedding_scale
        return x if scale == 1.0 else x * scale

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context: list,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [R, Q, hidden] block rows at positions [R, Q]; context: per layer (K, V)
        [R, C, kv_heads, D]; mask None or [R, Q, C + Q] bool -> [R, Q, hidden] after the final
        norm (the target's LM head turns it into draft logits)."""
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer, (k, v) in zip(self.layers, context):
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x)
