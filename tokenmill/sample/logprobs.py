"""Logprobs of chosen tokens plus the top-K alternatives.

Values are log_softmax of the RAW model logits (before temperature, penalties and filtering), as
vLLM reports by default, so they describe the model rather than the sampling settings. The same
function serves prompt_logprobs (logits at position t, token_ids = prompt token t + 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogprobsTensors:
    token_ids: torch.Tensor  # [B, K+1] int64: column 0 = the chosen token, then the top-K ids
    logprobs: torch.Tensor  # [B, K+1] float32
    ranks: torch.Tensor  # [B] int64: rank of the chosen token (1 = most likely)

    def tolists(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        """(token_ids, logprobs, ranks) as Python lists, one entry per row."""
        return self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()

    def slice_rows(self, start: int, end: int) -> "LogprobsTensors":
        return LogprobsTensors(self.token_ids[start:end], self.logprobs[start:end], self.ranks[start:end])


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    """logits [B, V] raw; token_ids [B] chosen tokens; num_top = K >= 0 alternatives per row."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    chosen_ids = token_ids.to(torch.int64).unsqueeze(1)  # [B, 1]
    chosen = logprobs.gather(1, chosen_ids)  # [B, 1]
    # Rank counts strictly better tokens, so ties share the better rank.
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if num_top > 0:
        top = logprobs.topk(num_top, dim=-1)
        ids = torch.cat([chosen_ids, top.indices], dim=1)
        values = torch.cat([chosen, top.values], dim=1)
    else:
        ids, values = chosen_ids, chosen
    return LogprobsTensors(token_ids=ids, logprobs=values, ranks=ranks)
