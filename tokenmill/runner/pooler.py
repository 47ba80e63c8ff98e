"""Pooling: a prompt-only request's final normed hidden states (the rows the LM head reads)
-> one vector, accumulated over the steps that compute its prompt chunks."""
from __future__ import annotations

import torch

from tokenmill.outputs import ModelRunnerOutput
from tokenmill.runner.input_builder import PoolingSlice, RunnerRequestState


def pool_rows(hidden: torch.Tensor, slices: list[PoolingSlice],
              states: dict[str, RunnerRequestState], out: ModelRunnerOutput) -> None:
    """hidden [T, hidden]. Called before the step's computed counts are advanced, so
    ``state.num_computed_tokens`` is the position of each slice's first row."""
    for sl in slices:
        if sl.req_id in out.errors:     # non-finite rows: the request fails, nothing to pool
            continue
        state = states[sl.req_id]
        rows = hidden[sl.first_row:sl.first_row + sl.num_rows].float()   # [num_rows, hidden]
        params = state.pooling_params
        if params.pooling_type == "last":
            state.pooled = rows[-1]
        elif state.pooled is None and state.num_computed_tokens != 0:
            # A mean needs every prompt row; the scheduler never gives such a request prefix
            # hits, so rows it did not see mean a scheduling bug, not a vector to return.
            out.errors[sl.req_id] = "mean pooling missed prompt rows (prefix-cache hit)"
            continue
        else:
            total = rows.sum(dim=0)
            state.pooled = total if state.pooled is None else state.pooled + total
        if sl.completes_prompt:
            out.pooled[sl.req_id] = finish_pooling(state).tolist()


def finish_pooling(state: RunnerRequestState) -> torch.Tensor:
    """The request's vector [hidden] from what was accumulated: the mean over the prompt, or
    the last row; L2-normalised when asked."""
    vec = state.pooled
    if state.pooling_params.pooling_type == "mean":
        vec = vec / len(state.prompt_token_ids)
    if state.pooling_params.normalize:
        vec = torch.nn.functional.normalize(vec, dim=0)
    return vec
