"""Pieces the EAGLE-3 and DFlash reference tests share: a request state as proposers read it,
and RMSNorm written out from its definition."""
from dataclasses import dataclass, field
from typing import Optional

import torch

from tokenmill import SamplingParams

# prompts of many lengths (1..64 tokens), one with repeats
PROMPTS = [[(17 * i + 5 * j) % 380 + 3 for j in range(n)] for i, n in
           enumerate([5, 9, 1, 23, 40, 3, 17, 64, 2, 31])]
PROMPTS[1] = PROMPTS[1] * 3


def run(llm, prompts, n=20):
    """Greedy token ids of ``n`` tokens per prompt."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


@dataclass
class State:
    """What a proposer reads of a runner request state (a greedy request)."""
    req_id: str
    all_tokens: list
    block_ids: list
    num_tokens: int
    output_token_ids: list = field(default_factory=list)
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    seed: Optional[int] = None
    drawn_noise: dict = field(default_factory=dict)
    noise_budget: Optional[object] = None

    def tokens(self, start, end):
        return self.all_tokens[start:end]


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
