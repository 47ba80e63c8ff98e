import torch
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up for a fused [T, 2 * inter] gate_up projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [T, 2*inter] -> [T, inter]
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
