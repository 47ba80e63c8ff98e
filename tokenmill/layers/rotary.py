"""Rotary position embedding (HF "rotate half" layout) with the scaling variants Llama-family
configs use: none, linear, llama3, yarn. Others are rejected with a clear error."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from tokenmill.layers import cpu_ops

SUPPORTED_SCALING = ("default", "linear", "llama3", "yarn")


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


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(scaling: dict) -> float:
    """YaRN scales cos/sin (hence q.k) by this, unless the config pins ``attention_factor``."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
    return _yarn_mscale(factor)


def _yarn_inv_freq(rotary_dim: int, base: float, scaling: dict) -> torch.Tensor:
    """Blend interpolated (divided by factor) and original frequencies: dims that rotate
    fewer than ``beta_slow`` times over the original context are interpolated, dims that
    rotate more than ``beta_fast`` times kept, with a linear ramp in between."""
    factor = scaling["factor"]
    old_ctx = scaling.get("original_max_position_embeddings")
    if old_ctx is None:
        raise ValueError("yarn rope_scaling needs original_max_position_embeddings")
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    keep = 1 - ramp   # weight of the original (extrapolated) frequency
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def scaling_kind(scaling: Optional[dict]) -> str:
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default"))


def check_scaling(scaling: Optional[dict]) -> None:
    kind = scaling_kind(scaling)
    if kind not in SUPPORTED_SCALING:
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED_SCALING)})")


def compute_inv_freq(rotary_dim: int, base: float, scaling: Optional[dict]) -> torch.Tensor:
    check_scaling(scaling)
    kind = scaling_kind(scaling)
    if kind == "yarn":
        return _yarn_inv_freq(rotary_dim, base, scaling)
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


class RotaryEmbedding(nn.Module):
    cpu_kernels = True   # the fused C kernel where it applies (cpu_ops.set_cpu_kernels)
    triton_kernels = False   # the Triton kernel (CUDA backend; kernel_choice.set_triton_kernels)

    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: Optional[dict] = None) -> None:
        super().__init__()
        inv_freq = compute_inv_freq(head_dim, base, scaling)
        mscale = yarn_attention_factor(scaling) if scaling_kind(scaling) == "yarn" else 1.0
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)                      # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)               # [P, D]
        self.register_buffer("cos", emb.cos() * mscale, persistent=False)
        self.register_buffer("sin", emb.sin() * mscale, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                step_cache: Optional[dict] = None):
        # positions [T]; q [T, Hq, D]; k [T, Hkv, D]. step_cache (per-step, e.g. the attention
        # metadata's plan_cache) lets every layer reuse one cos/sin lookup.
        if self.triton_kernels:   # in place, like the C kernel; positions are indexed on device
            from tokenmill.layers import triton_ops
            triton_ops.rope_(q, k, self.cos, self.sin, positions)
            return q, k
        if self._fused_ok(positions, step_cache) and cpu_ops.rope_(q, k, self.cos, self.sin, positions):
            return q, k    # rotated in place (q, k are fresh projections the caller owns)
        key = ("rope", id(self))
        cos_sin = step_cache.get(key) if step_cache is not None else None
        if cos_sin is None:
            cos_sin = (self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))  # [T, 1, D]
            if step_cache is not None:
                step_cache[key] = cos_sin
        cos, sin = cos_sin
        return _apply(q, cos, sin), _apply(k, cos, sin)


    def _fused_ok(self, positions: torch.Tensor, step_cache: Optional[dict]) -> bool:
        # The kernel indexes the tables without bounds checks: check the positions once per
        # step (the per-step cache is shared by all layers).
        if not (self.cpu_kernels and cpu_ops.available()) or positions.device.type != "cpu":
            return False
        key = ("rope_in_range", id(self))
        ok = step_cache.get(key) if step_cache is not None else None
        if ok is None:
            ok = positions.numel() == 0 or (int(positions.min()) >= 0
                                            and int(positions.max()) < self.cos.shape[0])
            if step_cache is not None:
                step_cache[key] = ok
        return ok


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
