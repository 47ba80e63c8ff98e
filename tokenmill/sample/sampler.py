"""Sampler: processed logits -> one token per row, plus logprobs when asked.

Order: logit_bias -> min_tokens -> repetition penalty -> presence/frequency penalties; then
greedy rows take the argmax, random rows go through temperature -> top-k -> top-p -> min-p and
draw one sample.

Sampling inverts the row's cumulative distribution at one uniform draw u: the first token whose
running sum (float64) exceeds u x total. One draw per row and step is what makes a seeded
request reproducible whatever batch it is in or row it sits at. (An exponential race,
argmax(p / E) with E ~ Exp(1), draws V values a row: 1.4 ms for a 49k vocabulary on CPU, a
quarter of a batch-8 decode step, against ~0.1 ms here.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from tokenmill.sample.filters import apply_min_p, apply_top_k_top_p
from tokenmill.sample.logprobs import LogprobsTensors, compute_logprobs
from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sample.penalties import apply_logits_processors

__all__ = ["Argmax", "LogprobsTensors", "SamplerOutput", "Sampler", "compute_logprobs",
           "filtered_probs", "torch_argmax"]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: Optional[LogprobsTensors]  # only when some row asked for logprobs (K = max over rows)


Argmax = Callable[[torch.Tensor], torch.Tensor]   # [R, V] -> int64 [R], torch.argmax's answer


def torch_argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


class Sampler:
    def __init__(self, argmax: Argmax = torch_argmax) -> None:
        # the runner passes a faster exact one where it has one (the CPU kernels')
        self.argmax = argmax

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # logits [B, V] float32, raw model output; left untouched (logprobs read it).
        logits = logits.float()
        processed = apply_logits_processors(logits, meta)
        if meta.all_greedy:
            sampled = self.argmax(processed)
        else:
            sampled = _sample_mixed(processed, meta, self.argmax)
        logprobs = None
        if meta.max_num_logprobs is not None:
            logprobs = compute_logprobs(logits, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def filtered_probs(random_logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Sampling distribution [R, V] of the random rows: temperature, top-k, top-p, min-p.

    ``random_logits`` [R, V] are the processed logits of ``meta.random_rows`` (in that order).
    Also the target distribution a rejection sampler needs.
    """
    scaled = random_logits / meta.temperature
    scaled = apply_top_k_top_p(scaled, meta.top_k, meta.top_p)
    if meta.min_p is not None:
        scaled = apply_min_p(scaled, meta.min_p)
    return scaled.softmax(dim=-1)


def _sample_mixed(processed: torch.Tensor, meta: SamplingMetadata, argmax: Argmax) -> torch.Tensor:
    random_logits = processed if meta.all_random else processed[meta.random_rows]
    random_tokens = sample_from_probs(filtered_probs(random_logits, meta), meta)
    if meta.all_random:
        return random_tokens
    sampled = argmax(processed)  # greedy rows; random rows are overwritten next
    sampled[meta.random_rows] = random_tokens
    return sampled


def sample_from_probs(probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """One token per row of probs [R, V] (non-negative, not necessarily normalized), using
    each row's generator as described in meta. A token of zero mass is never drawn."""
    u = _row_uniforms(meta, probs.shape[0], probs.device)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)       # float64: a 1e-8 token keeps its odds
    x = (u * cdf[:, -1]).unsqueeze(1)
    tokens = torch.searchsorted(cdf, x, right=True).squeeze(1)
    over = tokens >= probs.shape[1]    # u x total rounded up to total: the last token with mass
    if bool(over.any()):
        flipped = (probs[over] > 0).flip(-1).to(torch.uint8)
        tokens[over] = probs.shape[1] - 1 - flipped.argmax(dim=-1)
    return tokens


def _row_uniforms(meta: SamplingMetadata, num_rows: int, device: torch.device) -> torch.Tensor:
    """[R] float64 U[0, 1) (53 bits: a token of mass 1e-12 keeps its odds): unseeded rows share
    one draw, each seeded row draws one value alone."""
    u = torch.empty(num_rows, dtype=torch.float64, device=device)
    unseeded = meta.unseeded_random
    if unseeded is not None:
        if unseeded.numel() == num_rows:
            u.uniform_(generator=meta.shared_generator)
        else:
            u[unseeded] = torch.rand(unseeded.numel(), generator=meta.shared_generator,
                                     dtype=torch.float64, device=device)
    for position, generator in meta.seeded_random:
        u[position] = torch.rand(1, generator=generator, dtype=torch.float64, device=device)[0]
    return u
