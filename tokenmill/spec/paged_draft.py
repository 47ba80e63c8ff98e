"""Drafting with a paged causal LM: ``draft_model`` (a separate model sharing the tokenizer,
with its own KV tensors indexed by the target's block tables) and ``layer_skip`` (the target's
first N layers + its final norm and head, writing into the target's own first N layer caches).

Per step and request: feed the tokens the draft has not processed yet (up to and including the
newest token), take the argmax (at T > 0: the race with the target's noise, spec/coupled.py),
then feed each draft back for k - 1 more single-token passes.
Draft K/V for the last token and the drafts go into the scheduler's lookahead slots; the target
overwrites them when it verifies.

Catch-up (draft_model only): the draft's cache is valid up to the first position where what it
was fed differs from the request's true tokens; everything from there on is fed again next
time. layer_skip needs none: the target's own K/V at layers < N for verified tokens is exactly
what the shallow pass would compute.
"""
from __future__ import annotations

import torch

from tokenmill.spec.coupled import draft_tokens


class PagedDraftProposer:
    needs_lookahead = True
    aux_layers = ()
    couples_noise = True   # random rows race with the target's noise (spec/coupled.py)

    def __init__(self, model: torch.nn.Module, kv_caches: list, backend, block_size: int,
                 device: torch.device, catch_up: bool, vocab: int) -> None:
        self.model = model              # forward(ids, positions, kv_caches, meta, backend) + compute_logits
        self.vocab = vocab              # the target's logits width: the noise rows' length
        self.kv_caches = kv_caches      # one (K, V) per layer the draft runs
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.catch_up = catch_up
        self._fed: dict[str, tuple[int, list[int]]] = {}   # req_id -> (valid_until, tokens fed after)

    def drop(self, req_ids) -> None:
        for req_id in req_ids:
            self._fed.pop(req_id, None)

    def _first_unfed(self, state) -> int:
        """First position whose draft K/V is missing or stale."""
        newest = state.num_tokens - 1
        if not self.catch_up:
            return newest
        valid, fed = self._fed.get(state.req_id, (0, []))
        truth = state.tokens(valid, min(valid + len(fed), state.num_tokens))
        same = 0
        while same < len(truth) and fed[same] == truth[same]:
            same += 1
        return min(valid + same, newest)

    @torch.inference_mode()
    def propose(self, inp) -> list[list[int]]:
        states, num_drafts = inp.states, inp.num_drafts
        active = [i for i, k in enumerate(num_drafts) if k > 0]
        drafts: list[list[int]] = [[] for _ in states]
        if not active:
            return drafts
        starts = {i: self._first_unfed(states[i]) for i in active}
        chunks = {i: states[i].tokens(starts[i], states[i].num_tokens) for i in active}
        # What the draft cache will hold from each start on: the chunk, then all drafts but
        # the last (which is never fed).
        for i in active:
            self._fed[states[i].req_id] = (starts[i], list(chunks[i]))
        for step in range(max(num_drafts[i] for i in active)):
            rows = [i for i in active if num_drafts[i] > step]
            tokens = self._forward(states, rows, starts, chunks, step)
            for i, t in zip(rows, tokens):
                drafts[i].append(t)
                starts[i] += len(chunks[i])
                chunks[i] = [t]
                if step + 1 < num_drafts[i]:
                    self._fed[states[i].req_id][1].append(t)
        return drafts

    def _forward(self, states, rows: list[int], starts: dict, chunks: dict, step: int) -> list[int]:
        """One batched pass: chunk i at positions starts[i].. ; a draft after each chunk (its
        output position: the tokens emitted so far + step)."""
        ids, positions, q_lens, seq_lens, tables, last = [], [], [], [], [], []
        for i in rows:
            c, p0 = chunks[i], starts[i]
            ids.extend(c)
            positions.extend(range(p0, p0 + len(c)))
            q_lens.append(len(c))
            seq_lens.append(p0 + len(c))
            tables.append(states[i].block_ids)
            last.append(len(ids) - 1)
        meta = self.backend.build_metadata(q_lens, seq_lens, tables, self.block_size, self.device)
        dev = self.device
        h = self.model(torch.tensor(ids, dtype=torch.int64, device=dev),
                       torch.tensor(positions, dtype=torch.int64, device=dev),
                       self.kv_caches, meta, self.backend)
        logits = self.model.compute_logits(h[torch.tensor(last, dtype=torch.int64, device=dev)])
        drafters = [states[i] for i in rows]
        # a draft model's head may be padded past the target's vocabulary: never draft there
        return draft_tokens(logits[:, :self.vocab].float(), drafters,
                            [len(s.output_token_ids) + step for s in drafters], self.vocab).tolist()

