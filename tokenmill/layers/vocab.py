"""Vocab-parallel embedding: rank r of a tensor-parallel group holds rows
[r * ceil(V / tp), (r + 1) * ceil(V / tp)) of the table (zero rows past V). A lookup takes
the ids in its range, zeroes the others, and one all-reduce sums the ranks' rows. Its
twin is the column-parallel LM head with ``gather_output`` (layers/linear.py), whose rows
are split the same way, so a tied head shares this rank's piece."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.parallel_state import SINGLE, TPGroup
from tokenmill.layers.linear import _narrow_padded
from tokenmill.layers.lazy import materialize


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup = SINGLE) -> None:
        rows = -(-num_embeddings // tp.size)
        # an uninitialised table: the checkpoint fills it (nn.Embedding's random init would
        # touch every page of it: 671 MB for Gemma3, even when a packed head replaces it)
        super().__init__(rows, embedding_dim, _weight=torch.empty(rows, embedding_dim))
        self.weight.requires_grad_(False)
        self.tp = tp
        self.full_num_embeddings = num_embeddings
        self.vocab_start = tp.rank * rows
        self.vocab_end = min(num_embeddings, self.vocab_start + rows)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None, name: str = "") -> None:
        expected = (self.full_num_embeddings, self.embedding_dim)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"tensor {name!r} has shape {tuple(loaded.shape)}, expected {expected}")
        piece = materialize(_narrow_padded(loaded, 0, self.vocab_start, self.num_embeddings))
        param.data.copy_(piece)

    weight_loader.accepts_lazy = True

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:   # [T] -> [T, hidden]
        if not self.tp.is_parallel:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_end - self.vocab_start)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0.0))
