"""PoolingParams: how a prompt-only (pooling) request turns its hidden states into one vector.

A pooling request is scheduled like any prefill (chunked, batched with generation requests),
never samples, and finishes once its prompt is computed. Validated at construction; every
invalid value raises ``ValueError`` naming the parameter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

POOLING_TYPES = ("mean", "last")


@dataclass(frozen=True)
class PoolingParams:
    """``pooling_type``: "mean" averages the final normed hidden state (the rows the LM head
    reads) over every prompt position; "last" takes the last position's, which a causal model
    has read the whole prompt into. ``normalize`` divides by the L2 norm, so cosine similarity
    becomes a dot product. ``dimensions``: None, or the model's hidden size (checked once the
    model is known; truncating to fewer dimensions is not supported)."""

    pooling_type: str = "mean"
    normalize: bool = True
    dimensions: Optional[int] = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                             f"got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean, got {self.normalize!r}")
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"dimensions must be a positive integer, got {d!r}")

    @property
    def needs_every_prompt_row(self) -> bool:
        """Mean pooling reads every prompt position's hidden state, so such a request takes
        no prefix-cache hits (a hit would skip rows); "last" only needs the last row, which
        is always computed."""
        return self.pooling_type == "mean"

    def check_hidden_size(self, hidden_size: Optional[int]) -> None:
        if self.dimensions is not None and self.dimensions != hidden_size:
            raise ValueError(f"dimensions must equal the model's hidden size ({hidden_size}); "
                             f"truncated embeddings are not supported, got {self.dimensions}")
