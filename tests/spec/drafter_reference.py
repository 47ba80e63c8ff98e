"""Pieces the EAGLE-3 and DFlash reference tests share: a request state as proposers read it,
and RMSNorm written out from its definition."""
from dataclasses import dataclass

import torch


@dataclass
class State:
    req_id: str
    all_tokens: list
    block_ids: list
    num_tokens: int

    def tokens(self, start, end):
        return self.all_tokens[start:end]


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
