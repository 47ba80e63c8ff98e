"""Medusa heads trained on the target's own continuations: head i reads the post-norm hidden
state h_p that produced token p + 1 and learns token p + 2 + i (cross-entropy on the
target's greedy tokens, head i weighted 0.8^i as in the Medusa paper). The heads share the
target's LM head (frozen) and start as identity maps (zeroed ResBlock weights), so before
training every head repeats the target's own next-token guess."""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from tokenmill.spec.heads import MedusaHeads, save_medusa
from tokenmill.spec.train.target_ops import head_logits


class MedusaRecipe:
    method = "medusa"

    def aux_layers(self, target) -> tuple[int, ...]:
        return ()

    def build(self, target, options: dict, seed: int, data=None) -> MedusaHeads:
        a = target.args
        heads = MedusaHeads(a.hidden_size, a.vocab_size, int(options.get("num_heads", 4)),
                            int(options.get("num_layers", 1)), shared_lm_head=True)
        with torch.no_grad():
            for p in heads.parameters():
                p.zero_()
        self.positions = int(options.get("positions_per_sequence", 32))
        return heads

    def _rows(self, seq, head: int, limit: int) -> list[int]:
        """Positions p whose token p + 2 + head is a continuation token."""
        lo = max(seq.prompt_len - 2 - head, 0)
        hi = seq.num_tokens - 2 - head
        rows = list(range(lo, hi))
        return rows if len(rows) <= limit else sorted(random.sample(rows, limit))

    def loss(self, heads: MedusaHeads, target, batch) -> tuple[torch.Tensor, dict]:
        total, weight, correct, count = 0.0, 0.0, 0, 0
        for i in range(heads.num_heads):
            feats, labels = [], []
            for seq in batch:
                rows = self._rows(seq, i, self.positions)
                if rows:
                    idx = torch.tensor(rows)
                    feats.append(seq.final[idx])
                    labels.append(seq.token_ids[idx + 2 + i])
            if not feats:
                continue
            logits = head_logits(target, heads.medusa_head[i](torch.cat(feats)))
            labels = torch.cat(labels)
            total = total + (0.8 ** i) * F.cross_entropy(logits, labels)
            weight += 0.8 ** i
            if i == 0:
                correct += int((logits.argmax(-1) == labels).sum())
                count += int(labels.numel())
        if weight == 0:
            raise ValueError("medusa: no continuation long enough to train on")
        loss = total / weight
        return loss, {"loss": loss.item(), "acc": correct / max(count, 1)}

    @torch.no_grad()
    def acceptance(self, heads: MedusaHeads, target, seqs, k: int) -> list[float]:
        k = min(k, heads.num_heads)
        hits = [0] * k
        total = 0
        for seq in seqs:
            rows = self._rows(seq, 0, 64)
            if not rows:
                continue
            guesses = heads.logits(seq.final[torch.tensor(rows)], k, target).argmax(-1)   # [R, k]
            for r, p in enumerate(rows):
                total += 1
                for j in range(k):
                    if p + 2 + j >= seq.num_tokens or guesses[r, j] != seq.token_ids[p + 2 + j]:
                        break
                    hits[j] += 1
        return [h / max(total, 1) for h in hits] + [0.0] * (k - len(hits))

    def save(self, heads: MedusaHeads, target, out_dir: str) -> None:
        save_medusa(heads, out_dir)
