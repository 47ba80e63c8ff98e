"""Sampler: processed logits -> one token per row, plus logprobs when asked.

Order: logit_bias -> min_tokens -> repetition penalty -> presence/frequency penalties; then
greedy rows take the argmax, random rows go through temperature -> top-k -> top-p -> min-p and
draw one sample.

Sampling uses the exponential-race trick: argmax(p / q) with q ~ Exp(1) i.i.d. picks token i with
probability p_i. It needs exactly one draw of V noise values per row and step, which is what
makes a seeded request reproducible whatever batch it is in or row it sits at.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from tokenmill.sample.filters import apply_min_p, apply_top_k_top_p
from tokenmill.sample.logprobs import LogprobsTensors, compute_logprobs
from tokenmill.sample.metadata import SamplingMetadata, make_request_generator, step_seed
from tokenmill.sample.penalties import apply_logits_processors

__all__ = ["Argmax", "LogprobsTensors", "SamplerOutput", "Sampler", "compute_logprobs",
           "filtered_probs", "position_noise", "torch_argmax"]


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
    random_tokens = sample_from_probs(filtered_probs(random_logits, meta), meta, argmax)
    if meta.all_random:
        return random_tokens
    sampled = argmax(processed)  # greedy rows; random rows are overwritten next
    sampled[meta.random_rows] = random_tokens
    return sampled


def sample_from_probs(probs: torch.Tensor, meta: SamplingMetadata,
                      argmax: Argmax = torch_argmax) -> torch.Tensor:
    """One token per row of probs [R, V], using each row's generator as described in meta."""
    noise = _exponential_noise(meta, probs.shape, probs.device)
    # -log(U) with U < 1 is > 0; the clamp only guards p / noise against a zero divisor.
    scores = probs / noise.clamp_min_(torch.finfo(torch.float32).tiny)
    # A filtered token (p == 0) must never win, not even when every score underflows.
    scores.masked_fill_(probs <= 0, -1.0)
    return argmax(scores)


def position_noise(seed: int, position: int, vocab: int, device) -> torch.Tensor:
    """[vocab] Exp(1) noise of a seeded request's draw at output ``position``: the very values
    the race above uses for that row (the runner seeds the row's generator the same way)."""
    generator = make_request_generator(step_seed(seed, position), device)
    noise = torch.empty(vocab, dtype=torch.float32, device=device).uniform_(generator=generator)
    return noise.log_().neg_()


def _exponential_noise(meta: SamplingMetadata, shape: torch.Size, device: torch.device) -> torch.Tensor:
    """[R, V] Exp(1) noise: unseeded rows share one draw, each seeded row draws V values alone
    (or takes the row a drafter drew ahead from the same generator seed, meta.drawn_noise).
    Drawn as -log(U), U ~ U[0, 1): torch's CPU ``exponential_`` takes 1.4 ms for a 49k row,
    uniforms and a vector log 0.6 ms. (U = 0 gives +inf: that token's score is 0.)"""
    num_rows, vocab = shape
    noise = torch.empty(num_rows, vocab, dtype=torch.float32, device=device)
    unseeded = meta.unseeded_random
    if unseeded is not None:
        if unseeded.numel() == num_rows:
            noise.uniform_(generator=meta.shared_generator)
        else:
            noise[unseeded] = torch.rand(unseeded.numel(), vocab, generator=meta.shared_generator,
                                         device=device)
    for position, generator in meta.seeded_random:
        if position not in meta.drawn_noise:
            noise[position].uniform_(generator=generator)
    noise.log_().neg_()
    for position, row in meta.drawn_noise.items():
        noise[position] = row
    return noise
