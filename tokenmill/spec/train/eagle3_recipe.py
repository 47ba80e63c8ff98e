"""EAGLE-3 drafter trained on the target's own continuations with training-time test (TTT):
chains start at sampled positions b; step 0 is entry b over the context 0..b, step j feeds
step j - 1's output h with the true token t_{b+j} (EAGLE's choice: a draft only counts when
every earlier one was right, so the true token is the one that matters) and attends to the
context and the chain's earlier steps, exactly as it will when drafting (the same
``DenseChain`` the tests compare with the paged proposer). Step j learns the target's
next-token distribution at position b + j restricted to the draft vocabulary: KL from its
softmax (EAGLE-3's cross-entropy less the target's entropy: the same gradient, and 0 for a
perfect drafter), only where the target's choice is in that vocabulary (EAGLE-3's mask),
weighted ``step_decay ** j``. Only the continuation's tokens are labels.

Draft vocabulary: the ``draft_vocab`` most frequent tokens of the training continuations
(then of the prompts, then the lowest ids, when fewer are seen), as EAGLE-3 picks it.

Start: N(0, 0.02) weights (HF's default, as EAGLE-3) except ``lm_head`` and ``norm``, which
start as the target's rows for the draft vocabulary and its final norm: the drafter's output
lives where the target's last hidden state does, so it starts from a sensible readout.

Options: draft_vocab (8192), ttt_steps (3), positions_per_sequence (32: chains per sequence
and step; cost is per chain, the context K/V is one pass), step_decay (0.8, EAGLE's).
"""
from __future__ import annotations

import itertools
import random

import torch
import torch.nn.functional as F

from tokenmill.spec.trainable import init_weights
from tokenmill.spec.eagle3 import config_for_target, save_eagle3
from tokenmill.spec.eagle3_model import (DenseChain, Eagle3Head, default_aux_layers,
                                         previous_features)
from tokenmill.spec.train.data import choose_draft_vocab
from tokenmill.spec.train.target_ops import head_weight

_OPTIONS = ("draft_vocab", "ttt_steps", "positions_per_sequence", "step_decay")


class Eagle3Recipe:
    method = "eagle3"

    def aux_layers(self, target) -> tuple[int, ...]:
        return default_aux_layers(target.args.num_hidden_layers)

    def build(self, target, options: dict, seed: int, data=None) -> Eagle3Head:
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise ValueError(f"eagle3: unknown options {unknown}; known: {list(_OPTIONS)}")
        self.steps = int(options.get("ttt_steps", 3))
        self.per_sequence = int(options.get("positions_per_sequence", 32))
        self.decay = float(options.get("step_decay", 0.8))
        vocab = int(options.get("draft_vocab", 8192))
        c = config_for_target(target, vocab, self.aux_layers(target))
        head = init_weights(Eagle3Head(c), seed, std=0.02).float()
        ids = choose_draft_vocab(data, c.vocab_size, c.draft_vocab_size)
        head.set_vocab(ids)
        w = head_weight(target)
        with torch.no_grad():
            head.lm_head.weight.copy_(w[ids.to(w.device)].float())
            head.norm.weight.copy_(target.model.norm.weight.float())
        return head

    # -- the unrolled chains ---------------------------------------------------------------------
    @staticmethod
    def _starts(seq, limit: int, sample: bool, first: int) -> list[int]:
        """Chain starts b in [first, N - 2] (b + 1 has a label): ``limit`` drawn from the global
        ``random`` (seeded per step by the trainer) or spread evenly."""
        lo, hi = max(first, 0), seq.num_tokens - 2
        if hi < lo:
            return []
        count = hi - lo + 1
        if count <= limit:
            return list(range(lo, hi + 1))
        if sample:
            return sorted(random.sample(range(lo, hi + 1), limit))
        return [lo + (i * (count - 1)) // max(limit - 1, 1) for i in range(limit)]

    def _unroll(self, head: Eagle3Head, target, seqs: list, starts: list, steps: int) -> tuple:
        """Chains from ``starts[i]`` (positions in ``seqs[i]``), all sequences packed into one
        DenseChain (one matmul per projection, not one per sequence), fed the true tokens.
        -> (draft logits [steps, S, draft_vocab], ``at`` [steps, S]: the packed row whose next
        token step j guesses, ``ok`` [steps, S]: that token exists, packed tokens, finals)."""
        dev = head.fc.weight.device
        lengths = [s.num_tokens for s in seqs]
        first = [0, *itertools.accumulate(lengths)][:-1]       # packed row of each position 0
        tokens = torch.cat([s.token_ids for s in seqs]).to(dev)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(dev)
        doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).to(dev)
        flat = torch.tensor([first[i] + b for i, bs in enumerate(starts) for b in bs], device=dev)
        last = torch.tensor([first[i] + lengths[i] - 1 for i, bs in enumerate(starts) for _ in bs],
                            device=dev)                     # each chain's sequence's last row
        embeds = head.embed(target.model.embed_tokens, tokens).detach()
        g = head.project(torch.cat([s.aux for s in seqs]).to(dev))
        chain = DenseChain(head, embeds, previous_features(g, lengths), positions, flat, doc)
        h = chain.step()
        logits = [head.logits(h)]
        for j in range(1, steps):
            h = chain.step(embeds[torch.minimum(flat + j, last)], h)
            logits.append(head.logits(h))
        at = flat[None, :] + torch.arange(steps, device=dev)[:, None]
        ok = at < last[None, :]
        finals = torch.cat([s.final for s in seqs]).to(dev)
        return torch.stack(logits), torch.minimum(at, last[None, :] - 1), ok, tokens, finals

    @staticmethod
    def _draft_rows(head: Eagle3Head, target) -> torch.Tensor:
        """[draft_vocab, hidden]: the target's LM head rows of the draft vocabulary."""
        w = head_weight(target)
        return w[head.draft_ids().to(w.device)]

    @staticmethod
    def _target_probs(target, w_draft: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """rows [R, hidden] (target final states) -> its distribution over the draft vocab."""
        logits = F.linear(rows.to(w_draft.device, w_draft.dtype), w_draft).float()
        cap = getattr(target.args, "final_logit_softcapping", None)
        return (torch.tanh(logits / cap) * cap if cap else logits).softmax(-1)

    # -- training ------------------------------------------------------------------------------
    def loss(self, head: Eagle3Head, target, batch) -> tuple[torch.Tensor, dict]:
        starts = [self._starts(s, self.per_sequence, True, s.prompt_len - 1) for s in batch]
        seqs = [s for s, b in zip(batch, starts) if b]
        if not seqs:
            raise ValueError("eagle3: no continuation long enough to train on")
        logits, at, ok, tokens, finals = self._unroll(head, target, seqs, [b for b in starts if b],
                                                      self.steps)
        label = tokens[at + 1]
        # EAGLE-3's mask: a label outside the draft vocabulary teaches nothing it can say
        keep = ok & head.t2d[label]
        if not bool(keep.any()):
            raise ValueError("eagle3: no label in the draft vocabulary to train on")
        decay = self.decay ** torch.arange(self.steps, device=logits.device, dtype=torch.float32)
        w = decay[:, None] * keep
        q = self._target_probs(target, self._draft_rows(head, target), finals[at.flatten()])
        q = q.view_as(logits)
        # KL(target || draft): the cross-entropy less the target's entropy (a constant), so a
        # perfect drafter scores 0 whatever the target's uncertainty
        kl = (q * (q.clamp_min(1e-20).log() - logits.log_softmax(-1))).sum(-1)     # [J, S]
        loss = (kl * w).sum() / w.sum()
        hit = (head.to_target(logits[0].argmax(-1)) == label[0]) & keep[0]
        acc = float(hit.sum()) / max(int(keep[0].sum()), 1)
        return loss, {"loss": float(loss.detach()), "acc": acc}

    @torch.no_grad()
    def acceptance(self, head: Eagle3Head, target, seqs, k: int) -> list[float]:
        """Held-out greedy acceptance: chains from up to 16 evenly spread starts per sequence
        inside the continuation; entry j is the share of chains whose drafts 1..j+1 all equal
        the sequence's tokens. Feeding the true tokens is exact here: a chain only counts up to
        its first miss."""
        starts = [self._starts(s, 16, False, s.prompt_len) for s in seqs]
        seqs = [s for s, b in zip(seqs, starts) if b]
        if not seqs:
            return [0.0] * k
        logits, at, ok, tokens, _ = self._unroll(head, target, seqs, [b for b in starts if b], k)
        right = (head.to_target(logits.argmax(-1)) == tokens[at + 1]) & ok     # [k, S]
        through = right.int().cumprod(0)          # drafts 1..j+1 all right
        return (through.float().mean(1)).tolist()

    def save(self, head: Eagle3Head, target, out_dir: str) -> None:
        save_eagle3(head, out_dir)
