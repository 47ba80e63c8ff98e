"""AWQ (Lin et al. 2023): activation-aware scaling and clipping before 4-bit rounding.

Terms. A *scaling group* is a set of Linears reading the same input x (q/k/v; gate/up) plus
the op that produces x (an RMSNorm, or up_proj for down_proj). Multiplying the group's input
columns by s and dividing the producing op's output by s changes nothing in float, but
quantization error on salient input channels (large mean |x|) shrinks. s = mean|x|^a /
mean|w|^(1-a), with a searched on a grid to minimise the group's output error. Clipping then
searches, per output row and group, a shrink of the weight range that minimises that error.
Llama-family only: the producing norm must be a plain multiplicative RMSNorm.
"""
from __future__ import annotations

import torch

from tokenmill.quantization.gptq import IntQuant, rtn

GRID = 20


def _fake_quant(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    return rtn(w, bits, group).dequantize()


def search_scale(x: torch.Tensor, w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """x [T, K] sampled inputs, w [N, K] the group's stacked weights -> s [K]."""
    x_mean = x.abs().mean(0)
    n, k = w.shape
    wg = w.abs().reshape(n, k // group, group)
    w_mean = (wg / wg.amax(dim=2, keepdim=True).clamp(min=1e-8)).reshape(n, k).mean(0)
    ref = x @ w.t()
    best, best_s = float("inf"), torch.ones(k)
    for i in range(GRID):
        a = i / GRID
        s = (x_mean.pow(a) / w_mean.pow(1 - a).clamp(min=1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = ((x / s) @ _fake_quant(w * s, bits, group).t() - ref).pow(2).mean().item()
        if err < best:
            best, best_s = err, s
    return best_s


def search_clip(x: torch.Tensor, w: torch.Tensor, bits: int, group: int,
                max_shrink: float = 0.5, steps: int = 10) -> torch.Tensor:
    """Per (row, group) largest |w| after clipping, chosen to minimise that group's partial
    output error on x. Returns the clipped w."""
    n, k = w.shape
    ng = k // group
    xg = x.reshape(-1, ng, group)                       # [T, ng, G]
    wg = w.reshape(n, ng, group)                        # [N, ng, G]
    ref = torch.einsum("tgc,ngc->tng", xg, wg)
    amax = wg.abs().amax(dim=2, keepdim=True)           # [N, ng, 1]
    best_err = torch.full((n, ng), float("inf"))
    best_max = amax.clone()
    for i in range(steps):
        m = amax * (1 - max_shrink * i / steps)
        q = _fake_quant(wg.clamp(-m, m).reshape(n, k), bits, group).reshape(n, ng, group)
        err = (torch.einsum("tgc,ngc->tng", xg, q) - ref).pow(2).mean(0)   # [N, ng]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better.unsqueeze(2), m, best_max)
    return wg.clamp(-best_max, best_max).reshape(n, k)


def awq_layer(tensors: dict, layer: str, inputs: dict, bits: int, group: int,
              clip: bool = True) -> dict[str, IntQuant]:
    """Scale, clip and quantize one llama decoder layer in place on HF-named float tensors.
    ``inputs``: fused-module name -> sampled input rows [T, K]."""
    attn, mlp = f"{layer}.self_attn", f"{layer}.mlp"
    groups = [  # (producer tensor, producer is a norm?, member prefixes, input key)
        (f"{layer}.input_layernorm.weight", True, [f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"], f"{attn}.qkv_proj"),
        (f"{layer}.post_attention_layernorm.weight", True, [f"{mlp}.gate_proj", f"{mlp}.up_proj"], f"{mlp}.gate_up_proj"),
        (f"{mlp}.up_proj.weight", False, [f"{mlp}.down_proj"], f"{mlp}.down_proj"),
    ]
    if tensors[f"{attn}.v_proj.weight"].shape == tensors[f"{attn}.o_proj.weight"].shape:
        groups.append((f"{attn}.v_proj.weight", False, [f"{attn}.o_proj"], f"{attn}.o_proj"))
    for producer, is_norm, members, key in groups:
        x = inputs[key]
        w = torch.cat([tensors[m + ".weight"] for m in members])
        s = search_scale(x, w, bits, group)
        for m in members:
            tensors[m + ".weight"] = tensors[m + ".weight"] * s
        tensors[producer] = tensors[producer] / (s if is_norm else s.unsqueeze(1))
        inputs[key] = x / s
    out = {}
    for key, members in ((f"{attn}.qkv_proj", ("q_proj", "k_proj", "v_proj")),
                         (f"{attn}.o_proj", ("o_proj",)),
                         (f"{mlp}.gate_up_proj", ("gate_proj", "up_proj")),
                         (f"{mlp}.down_proj", ("down_proj",))):
        for m in members:
            name = f"{key.rsplit('.', 1)[0]}.{m}"
            w = tensors.pop(name + ".weight")
            if clip and m not in ("q_proj", "k_proj"):   # q/k errors are softmax-damped
                w = search_clip(inputs[key], w, bits, group)
            out[name] = rtn(w, bits, group)
    return out
