"""Logits processors that run before greedy / random selection, in this order:

logit_bias -> min_tokens -> repetition penalty -> presence & frequency penalties -> grammar
mask (last, so no bias or penalty can bring a banned token back).

Each function updates ``logits`` in place; ``apply_logits_processors`` clones first so the raw
model logits stay intact for logprobs.
"""
from __future__ import annotations

import torch

from tokenmill.sample.grammar_mask import apply_token_bitmask
from tokenmill.sample.metadata import SamplingMetadata


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                     values: torch.Tensor) -> None:
    # logits [B, V]; rows/cols/values [N]; (row, col) pairs are unique (one dict per request).
    logits[rows, cols] += values


def apply_min_tokens(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> None:
    # A request below min_tokens must not end by id, so its stop ids become impossible.
    logits[rows, cols] = float("-inf")


def apply_repetition_penalty(logits: torch.Tensor, penalty: torch.Tensor, seen_mask: torch.Tensor) -> None:
    """HF/vLLM semantic: for tokens already seen (prompt or output), divide positive logits by the
    penalty and multiply negative ones, so penalty > 1 always makes them less likely."""
    # logits [B, V]; penalty [B, 1]; seen_mask [B, V] bool
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    torch.where(seen_mask, scaled, logits, out=logits)


def apply_presence_frequency(logits: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                             output_counts: torch.Tensor) -> None:
    """OpenAI semantic over output tokens: logit -= frequency * count + presence * (count > 0)."""
    # logits [B, V]; presence/frequency [B, 1]; output_counts [B, V] float32
    logits -= frequency * output_counts + presence * (output_counts > 0).to(logits.dtype)


def apply_logits_processors(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Processed copy of ``logits`` [B, V] (or ``logits`` itself when nothing applies)."""
    if not meta.needs_processing:
        return logits
    out = logits.clone()
    if meta.bias_rows is not None:
        apply_logit_bias(out, meta.bias_rows, meta.bias_cols, meta.bias_values)
    if meta.min_tokens_rows is not None:
        apply_min_tokens(out, meta.min_tokens_rows, meta.min_tokens_cols)
    if meta.repetition_penalty is not None:
        apply_repetition_penalty(out, meta.repetition_penalty, meta.seen_mask)
    if meta.output_counts is not None:
        apply_presence_frequency(out, meta.presence_penalty, meta.frequency_penalty, meta.output_counts)
    if meta.token_bitmask is not None:
        apply_token_bitmask(out, meta.token_bitmask)
        _grammar_over_min_tokens(out, logits, meta)
    return out


def _grammar_over_min_tokens(out: torch.Tensor, logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """A complete grammar allows only the end-of-sequence token, which min_tokens bans: such
    a row would have nothing left. The grammar wins there: the row is the raw logits under the
    mask alone (a request cannot be both shorter than min_tokens and follow its grammar)."""
    if meta.min_tokens_rows is None:
        return
    empty = torch.isneginf(out.amax(dim=-1)).nonzero().flatten()
    if empty.numel():
        rows = logits[empty].clone()
        apply_token_bitmask(rows, meta.token_bitmask[empty])
        out[empty] = rows
