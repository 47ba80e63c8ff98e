"""SamplingMetadata: one step's sampling settings for a batch, as tensors.

The model runner describes each request row with a ``RowSamplingState``; ``build_sampling_metadata``
turns the batch into tensors once per step so the sampler never loops over rows in Python except to
draw per-request seeded noise.

Terms:
- *greedy row*: temperature ~ 0, takes the argmax of the processed logits.
- *random row*: every other row; draws one sample from the filtered distribution.
- *seeded row*: a random row whose request has ``seed`` set; it owns a ``torch.Generator`` and
  draws from it exactly once per step, so its tokens do not depend on the batch around it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from tokenmill.sampling_params import SamplingParams


@dataclass
class RowSamplingState:
    """What the model runner knows about one request row."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated before this step
    generator: Optional[torch.Generator]  # per-request generator when params.seed is set, else None
    noise: Optional[torch.Tensor] = None  # [V] this row's Exp(1) noise, drawn ahead (spec/coupled.py)


@dataclass
class SamplingMetadata:
    """Batch sampling tensors. ``None`` means "no row needs this step", so the sampler skips it.

    Tensors named ``*_random`` are indexed by position among the random rows (``random_rows``),
    all others by batch row.
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    random_rows: Optional[torch.Tensor]  # [R] int64 batch rows that sample; None when all_greedy
    temperature: Optional[torch.Tensor]  # [R, 1] float32
    top_k: Optional[torch.Tensor]  # [R] int64, disabled rows hold vocab_size
    top_p: Optional[torch.Tensor]  # [R] float32, disabled rows hold 1.0
    min_p: Optional[torch.Tensor]  # [R] float32, disabled rows hold 0.0
    unseeded_random: Optional[torch.Tensor]  # [U] int64 positions among random rows without a seed
    seeded_random: list[tuple[int, torch.Generator]]  # (position among random rows, generator)
    shared_generator: Optional[torch.Generator]
    # logit_bias as a sparse update: logits[rows, cols] += values
    bias_rows: Optional[torch.Tensor] = None  # [N] int64
    bias_cols: Optional[torch.Tensor] = None  # [N] int64
    bias_values: Optional[torch.Tensor] = None  # [N] float32
    # min_tokens: logits[rows, cols] = -inf while a row is below its min_tokens
    min_tokens_rows: Optional[torch.Tensor] = None  # [M] int64
    min_tokens_cols: Optional[torch.Tensor] = None  # [M] int64
    repetition_penalty: Optional[torch.Tensor] = None  # [B, 1] float32
    seen_mask: Optional[torch.Tensor] = None  # [B, V] bool, token in prompt or output
    presence_penalty: Optional[torch.Tensor] = None  # [B, 1] float32
    frequency_penalty: Optional[torch.Tensor] = None  # [B, 1] float32
    output_counts: Optional[torch.Tensor] = None  # [B, V] float32, occurrences in the output
    max_num_logprobs: Optional[int] = None  # K = max over rows asking for logprobs
    # grammar: [B, ceil(V / 32)] int32 allowed-token bits (tokenmill.sample.grammar_mask)
    token_bitmask: Optional[torch.Tensor] = None
    random_row_ids: list[int] = field(default_factory=list)
    # seeded rows whose noise a drafter drew ahead: position among random rows -> [V] Exp(1)
    # noise, the very values their generator would give (sampler.position_noise)
    drawn_noise: dict = field(default_factory=dict)

    @property
    def needs_processing(self) -> bool:
        """True when some logits processor (bias, min_tokens, penalties) has work this step."""
        return (self.bias_rows is not None or self.min_tokens_rows is not None
                or self.repetition_penalty is not None or self.output_counts is not None
                or self.token_bitmask is not None)


_SEED_MIX = 0x9E3779B97F4A7C15


def step_seed(seed: int, num_output_tokens: int) -> int:
    """Seed of a seeded request's draw at one output position: a pure function of (seed,
    position), so the draw is the same whatever the batch and after preemption, and a
    drafter can read the noise of a position before the target draws it (spec/coupled.py)."""
    return (seed * 6364136223846793005 + num_output_tokens * _SEED_MIX + 1442695040888963407) % (2**63)


def make_request_generator(seed: int, device) -> torch.Generator:
    """A generator owned by one request; seeds anywhere in int64 are accepted."""
    generator = torch.Generator(device=torch.device(device))
    # manual_seed takes [-2**63, 2**64); negative seeds map to distinct states.
    generator.manual_seed(seed)
    return generator


def build_sampling_metadata(rows: list[RowSamplingState], vocab_size: int, device: torch.device,
                            shared_generator: Optional[torch.Generator] = None,
                            token_bitmask: Optional[torch.Tensor] = None) -> SamplingMetadata:
    device = torch.device(device)
    params = [r.params for r in rows]
    random_ids = [i for i, p in enumerate(params) if not p.is_greedy]
    meta = SamplingMetadata(
        num_rows=len(rows), vocab_size=vocab_size,
        all_greedy=not random_ids, all_random=len(random_ids) == len(rows),
        random_rows=None, temperature=None, top_k=None, top_p=None, min_p=None,
        unseeded_random=None, seeded_random=[], shared_generator=shared_generator,
        random_row_ids=random_ids, token_bitmask=token_bitmask)
    if random_ids:
        _fill_random_rows(meta, rows, random_ids, device)
    _fill_logit_bias(meta, params, device)
    _fill_min_tokens(meta, rows, device)
    _fill_penalties(meta, rows, vocab_size, device)
    asked = [p.logprobs for p in params if p.logprobs is not None]
    meta.max_num_logprobs = max(asked) if asked else None
    return meta


def _fill_random_rows(meta: SamplingMetadata, rows: list[RowSamplingState],
                      random_ids: list[int], device: torch.device) -> None:
    params = [rows[i].params for i in random_ids]
    V = meta.vocab_size
    meta.random_rows = torch.tensor(random_ids, dtype=torch.int64, device=device)
    meta.temperature = torch.tensor([[p.temperature] for p in params], dtype=torch.float32, device=device)
    # top_k >= V keeps everything, so treat it as disabled and avoid a useless sort.
    top_k = [p.top_k if 0 < p.top_k < V else V for p in params]
    if any(k < V for k in top_k):
        meta.top_k = torch.tensor(top_k, dtype=torch.int64, device=device)
    if any(p.top_p < 1.0 for p in params):
        meta.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    if any(p.min_p > 0.0 for p in params):
        meta.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
    generators = [rows[i].generator for i in random_ids]
    unseeded = [j for j, g in enumerate(generators) if g is None]
    if unseeded:
        meta.unseeded_random = torch.tensor(unseeded, dtype=torch.int64, device=device)
    meta.seeded_random = [(j, g) for j, g in enumerate(generators) if g is not None]
    meta.drawn_noise = {j: rows[i].noise for j, i in enumerate(random_ids)
                        if rows[i].noise is not None and generators[j] is not None}


def _fill_logit_bias(meta: SamplingMetadata, params: list[SamplingParams], device: torch.device) -> None:
    rows, cols, values = [], [], []
    for i, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            if token_id < meta.vocab_size:  # ids were validated against the tokenizer vocab
                rows.append(i)
                cols.append(token_id)
                values.append(bias)
    if rows:
        meta.bias_rows = torch.tensor(rows, dtype=torch.int64, device=device)
        meta.bias_cols = torch.tensor(cols, dtype=torch.int64, device=device)
        meta.bias_values = torch.tensor(values, dtype=torch.float32, device=device)


def _fill_min_tokens(meta: SamplingMetadata, rows: list[RowSamplingState], device: torch.device) -> None:
    mask_rows, mask_cols = [], []
    for i, r in enumerate(rows):
        if len(r.output_token_ids) < r.params.min_tokens:
            stops = [t for t in r.params.all_stop_token_ids if t < meta.vocab_size]
            mask_rows.extend([i] * len(stops))
            mask_cols.extend(stops)
    if mask_rows:
        meta.min_tokens_rows = torch.tensor(mask_rows, dtype=torch.int64, device=device)
        meta.min_tokens_cols = torch.tensor(mask_cols, dtype=torch.int64, device=device)


def _token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V] float32 occurrence counts, built with one scatter_add over a padded id matrix."""
    max_len = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.float32, device=device)
    if max_len == 0:
        return counts[:, :vocab_size]
    # Pad with the extra column vocab_size (also where out-of-range ids land), then drop it.
    padded = [[t if 0 <= t < vocab_size else vocab_size for t in ids] + [vocab_size] * (max_len - len(ids))
              for ids in token_lists]
    index = torch.tensor(padded, dtype=torch.int64, device=device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab_size]


def _fill_penalties(meta: SamplingMetadata, rows: list[RowSamplingState], vocab_size: int,
                    device: torch.device) -> None:
    params = [r.params for r in rows]
    if any(p.repetition_penalty != 1.0 for p in params):
        meta.repetition_penalty = torch.tensor([[p.repetition_penalty] for p in params],
                                               dtype=torch.float32, device=device)
        # Only rows with a penalty pay for their prompt; the others get an empty list (no-op anyway).
        seen = [list(r.prompt_token_ids) + list(r.output_token_ids) if r.params.repetition_penalty != 1.0
                else [] for r in rows]
        meta.seen_mask = _token_counts(seen, vocab_size, device) > 0
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        meta.presence_penalty = torch.tensor([[p.presence_penalty] for p in params],
                                             dtype=torch.float32, device=device)
        meta.frequency_penalty = torch.tensor([[p.frequency_penalty] for p in params],
                                              dtype=torch.float32, device=device)
        meta.output_counts = _token_counts([r.output_token_ids for r in rows], vocab_size, device)
