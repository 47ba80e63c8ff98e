"""Plain, trainable layers shared by the drafters (DFlash, EAGLE-3) and the draft-model
student. tokenmill.layers' versions freeze their weights and dispatch to inference kernels
(fused C, prepacked oneDNN) that have no backward; these run the same math in PyTorch, so one
module drafts in the engine and trains in tokenmill.spec.train."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import DRAFTER_QUANTIZATIONS
from tokenmill.layers import cpu_ops
from tokenmill.layers.quant.matmul import packed_linear
from tokenmill.layers.rotary import compute_inv_freq, scaling_kind, yarn_attention_factor


def _serving(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Inference (autograd not recording this call): the kernels without a backward may run."""
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))


class Linear(nn.Linear):
    """nn.Linear that, when autograd is not recording, runs decode-sized inputs (at most
    cpu_ops.LINEAR_MAX_ROWS rows) through tokenmill's streaming kernel: a drafter multiplies
    one to a few rows per step, and torch's small-M path reads each weight several times
    slower than the kernel does. Training (autograd on) always takes F.linear.

    ``packed`` (set by ``quantize_linears`` for serving): an int8 copy of the weight that
    every call without autograd takes instead, with q8 activations; the float weight is
    then gone, so such a layer cannot train."""

    packed = None   # tokenmill.layers.quant.formats.Packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _serving(x, self.weight):
            if self.packed is not None:
                return packed_linear(x, self.packed, self.bias, activations="q8").to(x.dtype)
            y = cpu_ops.linear(x if x.is_contiguous() else x.contiguous(), self.weight, self.bias)
            if y is not None:
                return y
        elif self.packed is not None:
            raise RuntimeError("this drafter serves int8 copies of its linears (quantize_linears) "
                               "and has no float weights left to train; train the float drafter")
        return super().forward(x)


class LinearGroup:
    """Sibling ``Linear``s that read the same input (k and v, gate and up): served as one int8
    matmul over their stacked rows when every one is packed (quantize_linears), one kernel
    call instead of several (a drafter's step is a row or a few, so each call's fixed cost
    counts as much as its bytes). Per-channel int8 rows quantize alone, so the stacked
    weight is the members' own. Else each member runs on its own. Not a module: the members
    stay where the checkpoint names them."""

    def __init__(self, *linears: Linear) -> None:
        self.linears = linears
        self.sizes = [m.out_features for m in linears]
        self._stacked = None      # (Packed, bias or None), built at the first packed call

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> the members' outputs side by side [..., sum of their N]."""
        if all(m.packed is not None and m.packed.kind == "i8" for m in self.linears) and \
                _serving(x, self.linears[0].weight):
            if self._stacked is None:
                self._stacked = self._stack()
            packed, bias = self._stacked
            return packed_linear(x, packed, bias, activations="q8").to(x.dtype)
        return torch.cat([m(x) for m in self.linears], dim=-1)

    def _stack(self) -> tuple:
        from tokenmill.layers.quant import qgemm
        from tokenmill.layers.quant.formats import Packed
        parts = [m.packed for m in self.linears]
        k = parts[0].in_features
        p = Packed("i8", torch.cat([q.stored() for q in parts]), torch.cat([q.scales for q in parts]),
                   None, k, sum(self.sizes), k)
        if qgemm.available():
            p.tiled = qgemm.tile(p)
            p.qweight = None      # the tiles are its only copy (Packed.stored reads them back)
        biases = [m.bias for m in self.linears]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else torch.zeros(n) for b, n in zip(biases, self.sizes)])
        return p, bias


def quantize_linears(module: nn.Module, method: str) -> int:
    """Serve every ``Linear`` of a drafter from per-channel int8 weights with int8-rounded
    activations (``method`` "int8"; the tiled VNNI / AVX2 kernel where the kernel library
    runs): a drafter's step streams its weights like the target's, so a quarter of the bytes
    drafts faster. A drafter only proposes, so exactness is the verification's, not its own.
    Returns the number of linears converted."""
    from tokenmill.layers.quant import qgemm
    from tokenmill.layers.quant.formats import quantize_int8
    if method not in DRAFTER_QUANTIZATIONS:
        raise ValueError(f"drafter quantization must be one of {DRAFTER_QUANTIZATIONS}, got {method!r}")
    count = 0
    for m in module.modules():
        if isinstance(m, Linear) and m.in_features % 32 == 0:   # q8 rounds runs of 32 values
            p = quantize_int8(m.weight.detach())
            if qgemm.available():
                p.tiled = qgemm.tile(p)
            m.packed = p
            # every call without autograd takes the packed copy: the float one would be dead
            # weight (35 MB of SmolLM2's EAGLE-3); an empty tensor keeps its dtype
            m.weight = nn.Parameter(m.weight.detach().new_empty(0), requires_grad=False)
            count += 1
    return count


class RMSNorm(nn.Module):
    """x / rms(x) * weight, in float32 like the HF reference."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [..., size]
        if x.dtype == torch.float32 and _serving(x, self.weight):
            y = cpu_ops.rms_norm(x, self.weight, self.eps)   # one kernel call, not six ops
            if y is not None:
                return y
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), with HF Llama's parameter names."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.gate_up = LinearGroup(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj.packed is not None and _serving(x, self.gate_proj.weight):
            both = self.gate_up(x)             # [..., 2I]: one int8 matmul
            flat = both.reshape(-1, both.shape[-1])
            y = cpu_ops.silu_mul(flat) if flat.dtype == torch.float32 else None
            if y is None:
                gate, up = flat.chunk(2, dim=-1)
                y = F.silu(gate) * up
            return self.down_proj(y.reshape(*both.shape[:-1], y.shape[-1]))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Rotary:
    """cos/sin for any positions, read from float32 tables that grow (doubling) to the
    largest position asked for (a block may sit past any fixed length): a drafting step
    indexes two tables instead of running ten ops, and training and serving read the same
    values. Not a module: nothing to save, and casting a drafter to bf16 must not round the
    frequencies."""

    def __init__(self, head_dim: int, theta: float, scaling: Optional[dict]) -> None:
        self.inv_freq = compute_inv_freq(head_dim, theta, scaling)           # [D/2] float32
        self.mscale = yarn_attention_factor(scaling) if scaling_kind(scaling) == "yarn" else 1.0
        self._tables: dict = {}       # device -> (cos, sin) [P, D] float32

    def _table(self, device: torch.device, size: int) -> tuple:
        tables = self._tables.get(device)
        if tables is None or tables[0].shape[0] < size:
            n = 256
            while n < size:
                n *= 2
            tables = self._tables[device] = self._formula(torch.arange(n, device=device))
        return tables

    def _formula(self, positions: torch.Tensor) -> tuple:
        # positions [...] -> cos, sin [..., D] float32
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self.mscale, emb.sin() * self.mscale

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        # positions [...] -> cos, sin [..., D]
        if positions.numel() and not positions.is_floating_point():
            lo, hi = torch.aminmax(positions)
            if int(lo) >= 0:
                cos, sin = self._table(positions.device, int(hi) + 1)
                return cos[positions].to(dtype), sin[positions].to(dtype)
        cos, sin = self._formula(positions)          # negative or fractional positions
        return cos.to(dtype), sin.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, heads, D]; cos, sin [..., T, D] (HF "rotate half" layout)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def init_weights(module: nn.Module, seed: int, std: float = 0.02) -> nn.Module:
    """HF's default initialisation for Llama / Qwen3 layers: N(0, std) matrices, zero biases,
    unit norm weights. Seeded, so a random drafter is reproducible."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * std)
            else:
                p.zero_()
    return module
