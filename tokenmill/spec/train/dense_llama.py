"""A Llama decoder stack in plain PyTorch for training (dense causal attention, autograd all
the way through), with the parameter names of an HF Llama checkpoint so its state dict saves
as one. The serving modules are not used for training: their paged attention, fused C
kernels and prepacked oneDNN linears have no backward."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.spec.trainable import RMSNorm, Rotary, SwiGLU, rotate


class _Attention(nn.Module):
    def __init__(self, a) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        h = a.hidden_size
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]   # x [N, H]: one sequence; cos, sin [N, D]
        q = rotate(self.q_proj(x).view(n, self.heads, self.head_dim), cos, sin)
        k = rotate(self.k_proj(x).view(n, self.kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(0, 1).reshape(n, -1))


class _Layer(nn.Module):
    def __init__(self, a) -> None:
        super().__init__()
        self.self_attn = _Attention(a)
        self.mlp = SwiGLU(a.hidden_size, a.intermediate_size)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x, cos, sin) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Stack(nn.Module):
    def __init__(self, a, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(a) for _ in range(num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class DenseLlama(nn.Module):
    """``num_layers`` Llama decoder layers + the final norm (names ``model.layers.*``,
    ``model.norm.weight``); the embedding and head stay the target's."""

    def __init__(self, a, num_layers: int) -> None:
        super().__init__()
        self.args, self.num_layers = a, num_layers
        self.model = _Stack(a, num_layers)
        self.rotary = Rotary(a.head_dim, a.rope_theta, a.rope_scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] embeddings of one sequence at positions 0..N-1 -> post-norm [N, H]."""
        cos, sin = self.rotary.cos_sin(torch.arange(x.shape[0], device=x.device), x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x)

    @classmethod
    def from_target(cls, target, num_layers: int) -> "DenseLlama":
        """The target's first ``num_layers`` layers and its final norm, copied."""
        from tokenmill.spec.shallow import _unfused
        a = target.args
        if not 1 <= num_layers <= a.num_hidden_layers:
            raise ValueError(f"num_layers must be in [1, {a.num_hidden_layers}], got {num_layers}")
        student = cls(a, num_layers)
        tensors = {}
        for name, param in target.named_parameters():
            if name.startswith("model.layers.") and int(name.split(".")[2]) < num_layers \
                    or name == "model.norm.weight":
                tensors.update(_unfused(target, name, param.detach().float()))
        missing, unexpected = student.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise ValueError(f"cannot copy the target's layers into a plain Llama stack "
                             f"(missing {missing[:4]}, unexpected {unexpected[:4]}): "
                             f"draft-model training supports plain Llama targets")
        return student
