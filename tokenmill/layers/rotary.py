"""Rotary position embedding (HF "rotate half" layout) with the scaling variants Llama-family
configs use: none, linear, llama3. Others are rejected with a clear error."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(rotary_dim: int, base: float, scaling: Optional[dict]) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope_scaling type {kind!r} is not supported yet (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: Optional[dict] = None) -> None:
        super().__init__()
        inv_freq = compute_inv_freq(head_dim, base, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)                      # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)               # [P, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions [T]; q [T, Hq, D]; k [T, Hkv, D]
        cos = self.cos[positions].unsqueeze(1)                # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        return _apply(q, cos, sin), _apply(k, cos, sin)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
