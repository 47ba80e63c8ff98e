"""What the runner hands a proposer after each step (built by the runner, read by spec/).

Layer numbering: ``aux_layers`` are decoder-layer indices (0-based); the feature of layer l at
a position is the residual stream *after* layer l there (before the final norm). In HF terms
that is ``output_hidden_states[l + 1]`` (index 0 is the embeddings); loaders of published
drafters convert their ids to this numbering.

Row alignment: the feature row of position p is computed from tokens 0..p, so it predicts
the token at p + 1. A proposer that keeps its own K/V (EAGLE-3, DFlash) indexes it by the
target's block tables: entries that depend only on tokens <= their position stay valid
under prefix caching (a cached block's entries were written when its tokens were verified).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class StepFeatures:
    """Target features of the tokens a step verified, for every request it ran: a prefill
    chunk's rows, a decode step's newest token, the accepted prefix of a verify run (the
    rejected drafts' rows are left out). Requests that failed this step are left out."""

    req_ids: list[str]
    starts: list[int]               # position of each request's first verified row
    counts: list[int]               # verified rows per request (>= 1)
    token_ids: list[list[int]]      # the tokens at those positions
    block_ids: list[list[int]]      # each request's block table (the target's)
    aux: torch.Tensor               # [sum(counts), len(aux_layers) * hidden], request-major

    def rows_of(self, index: int) -> torch.Tensor:
        """[counts[index], len(aux_layers) * hidden]: request ``index``'s feature rows."""
        start = sum(self.counts[:index])
        return self.aux[start:start + self.counts[index]]


@dataclass
class DraftInput:
    """One drafting call. ``states[i]`` / ``num_drafts[i]``: the requests to draft for now
    (may be empty when only ``features`` are news). ``hidden[i]``: the target's final (post
    norm) hidden state that produced request i's newest token. ``features``: present when the
    proposer asked for ``aux_layers``; it covers every request the step ran, drafted now or
    not, so a proposer can keep its context cache complete."""

    states: list
    num_drafts: list[int]
    hidden: Optional[torch.Tensor] = None            # [len(states), hidden]
    features: Optional[StepFeatures] = None
    extra: dict = field(default_factory=dict)        # reserved for proposer-specific inputs
    mode: int = 0      # index into the proposer's ``modes`` (0: as built), chosen by AdaptiveK
    # candidates per depth for a proposer that drafts trees (``tree_widths``; () or 1s: chains).
    # Such a proposer returns a spec.draft_tree.DraftTree for a request it branches for
    widths: tuple = ()


class AuxCapture:
    """Collects the residual stream after the chosen decoder layers during one forward
    (the model's forward calls ``offer`` after each layer)."""

    def __init__(self, layers: tuple[int, ...]) -> None:
        self.layers = tuple(layers)
        self._want = {layer: i for i, layer in enumerate(self.layers)}
        self.rows: list[Optional[torch.Tensor]] = [None] * len(self.layers)
        self._joined: Optional[torch.Tensor] = None

    def offer_joined(self, joined: torch.Tensor) -> None:
        """Every wanted layer at once: ``joined`` [T, len(layers) * hidden] in the order asked."""
        self._joined = joined
        self.rows = list(joined.chunk(len(self.layers), dim=-1))

    def offer(self, layer: int, x: torch.Tensor) -> None:
        i = self._want.get(layer)
        if i is not None:
            self.rows[i] = x.float()

    def concat(self) -> torch.Tensor:
        """[T, len(layers) * hidden], layers in the order asked."""
        missing = [layer for layer, r in zip(self.layers, self.rows) if r is None]
        if missing:
            raise RuntimeError(f"the forward did not offer decoder layers {missing}")
        return self._joined if self._joined is not None else torch.cat(self.rows, dim=-1)


class PendingFeatures:
    """Steps' features a drafter has not written into its context cache yet. Writing them
    costs a few dozen small ops a step whatever the row count, so while no drafts are asked
    for (adaptive k = 0) they wait and go in one call: before the next draft, or once
    ``max_rows`` have gathered. Kept in step order, so a slot written twice ends with its
    newest entry, as if each step had been written at once."""

    def __init__(self, max_rows: int = 256) -> None:
        self.max_rows = max_rows
        self.steps: list[StepFeatures] = []
        self.rows = 0

    def add(self, f: StepFeatures) -> None:
        self.steps.append(f)
        self.rows += int(f.aux.shape[0])

    def take(self) -> Optional[StepFeatures]:
        """Every pending step as one StepFeatures (entries in step order), or None."""
        steps, self.steps, self.rows = self.steps, [], 0
        if not steps:
            return None
        if len(steps) == 1:
            return steps[0]
        return StepFeatures([r for f in steps for r in f.req_ids], [x for f in steps for x in f.starts],
                            [n for f in steps for n in f.counts],
                            [t for f in steps for t in f.token_ids],
                            [b for f in steps for b in f.block_ids],
                            torch.cat([f.aux for f in steps]))


def last_writes(slots: torch.Tensor) -> torch.Tensor:
    """Indices into ``slots`` [N] of the last occurrence of each slot (ascending): a batched
    write that must end as sequential writes would."""
    order = torch.arange(slots.shape[0], device=slots.device)
    last = torch.full((int(slots.max()) + 1,), -1, dtype=torch.int64, device=slots.device)
    last.scatter_reduce_(0, slots, order, "amax")
    return order[last[slots] == order]


def record_then_draft(proposer, inp: DraftInput) -> list[list[int]]:
    """``propose`` of a drafter that keeps its own context cache (EAGLE-3, DFlash): queue the
    step's features (``proposer.pending``), write the queue (``proposer.record``) when drafts
    are wanted or it is full, then draft for the requests that want drafts
    (``proposer.draft(states, counts, widths)``: per state a list of at most counts[i]
    tokens, or a DraftTree with a chain that long)."""
    if inp.features is not None and inp.features.req_ids:
        proposer.pending.add(inp.features)
    rows = [i for i, n in enumerate(inp.num_drafts) if n > 0]
    if rows or proposer.pending.rows >= proposer.pending.max_rows:
        queued = proposer.pending.take()
        if queued is not None:
            proposer.record(queued)
    drafts: list[list[int]] = [[] for _ in inp.states]
    if rows:
        got = proposer.draft([inp.states[i] for i in rows], [inp.num_drafts[i] for i in rows],
                             inp.widths)
        for i, d in zip(rows, got):
            drafts[i] = d
    return drafts


def run_slots(f: StepFeatures, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] cache slots and [N] positions of every row of ``f`` (run i: positions starts[i] ..
    starts[i] + counts[i] - 1 through block table block_ids[i]), in one pass over plain ints:
    a queue of decode steps is hundreds of one-row runs, and tensor ops per run cost more
    than the rows."""
    slots: list[int] = []
    positions: list[int] = []
    for start, count, table in zip(f.starts, f.counts, f.block_ids):
        for p in range(start, start + count):
            slots.append(table[p // block_size] * block_size + p % block_size)
        positions.extend(range(start, start + count))
    return torch.tensor(slots, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64)


def paged_slots(block_ids: list[int], positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """positions [N] -> cache slots [N] through one request's block table (a drafter's own
    paged tensors are indexed like the target's)."""
    table = torch.tensor(block_ids, dtype=torch.int64)
    return table[positions // block_size] * block_size + positions % block_size


def validate_aux_layers(layers: tuple[int, ...], num_layers: int, who: str) -> tuple[int, ...]:
    """The ids as a tuple, or a clear error when one is outside the target's layers."""
    layers = tuple(int(x) for x in layers)
    bad = [x for x in layers if not 0 <= x < num_layers]
    if bad:
        raise ValueError(f"{who}: target layer ids {bad} outside the target's {num_layers} "
                         f"decoder layers (0..{num_layers - 1})")
    if len(set(layers)) != len(layers):
        raise ValueError(f"{who}: target layer ids {list(layers)} name a layer twice")
    return layers
