"""DFlash drafter trained on the target's own continuations by masked block denoising (z-lab's
objective, as SpecForge implements it): pick anchor positions a inside the continuation;
the block [token a, MASK, ..., MASK] at positions a..a+bs-1 sees the target's features at
positions < a (exactly what the engine has when a is the newest token) and itself; block row j
learns the token at a + j by cross-entropy, weighted exp(-(j - 1) / gamma) because a draft
only counts when every earlier one was accepted. The target's embeddings and LM head stay
frozen; logits are computed only at the labelled block rows (the LM head is most of the cost).

Options: num_layers (2), block_size (8), blocks_per_sequence (16: anchors per sequence and
step), loss_decay_gamma (block_size / 2, z-lab's suggestion: 7 for 16, 4 for 8),
mask_token_id (default: the last id, see tokenmill.spec.dflash.config_for_target),
draft_vocab (8192: the proposer's head keeps the most frequent continuation tokens, see
tokenmill.spec.draft_head; 0: the whole vocabulary).

Loss and held-out acceptance use the draft vocabulary's rows of the target's head, as the
proposer drafts (a label outside it has weight 0). The head is most of a step's cost: with
8192 of SmolLM2's 49152 rows a step of 16 anchors a sequence takes ~0.72 s on 2 cores, against
~0.52 s for 4 anchors over the whole vocabulary (held-out tau after 1200 steps 1.41 -> 1.58).

Draft layers start random like z-lab's (N(0, 0.02)); their shapes are the target's layers'.
(Starting them as copies of the target's last layers was measured and dropped: tau on the
continuations of `bench spec`'s chat prompts 1.45 against 1.52 from random, docs/bench/2026-12-06c.)
"""
from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

from tokenmill.spec.dflash import config_for_target, save_dflash
from tokenmill.spec.dflash_model import DFlashDrafter, init_weights, spread_layer_ids
from tokenmill.spec.train.data import choose_draft_vocab
from tokenmill.spec.train.target_ops import head_logits

_OPTIONS = ("num_layers", "block_size", "blocks_per_sequence", "loss_decay_gamma", "mask_token_id",
            "draft_vocab")


class DFlashRecipe:
    method = "dflash"

    def aux_layers(self, target) -> tuple[int, ...]:
        """Five target layers spread from layer 1 to L - 3 (most of z-lab's drafters read 5)."""
        return spread_layer_ids(target.args.num_hidden_layers, 5)

    def build(self, target, options: dict, seed: int, data=None) -> DFlashDrafter:
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise ValueError(f"dflash: unknown options {unknown}; known: {list(_OPTIONS)}")
        config = config_for_target(target, int(options.get("num_layers", 2)),
                                   int(options.get("block_size", 8)), self.aux_layers(target),
                                   options.get("mask_token_id"))
        self.per_sequence = int(options.get("blocks_per_sequence", 16))
        self.gamma = float(options.get("loss_decay_gamma", config.block_size / 2))
        drafter = init_weights(DFlashDrafter(config), seed).float()
        size = int(options.get("draft_vocab", 8192))   # 0: the whole vocabulary
        vocab = target.args.vocab_size
        drafter.draft_vocab_ids = choose_draft_vocab(data, vocab, size) if 0 < size < vocab else None
        return drafter

    @staticmethod
    def _row_of(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[vocab_size]: each target id's row in the draft vocabulary ``ids``, -1 outside it."""
        index = torch.full((vocab_size,), -1, dtype=torch.int64)
        index[ids] = torch.arange(ids.numel())
        return index

    # -- the block forward over one sequence ---------------------------------------------------
    @staticmethod
    def _anchors(seq, limit: int, rng=None) -> list[int]:
        """Positions a in the continuation with at least one token after them: ``limit`` drawn
        by ``rng`` (training) or spread evenly (evaluation, ``rng`` None)."""
        lo, hi = seq.prompt_len, seq.num_tokens - 2
        if hi < lo:
            return []
        count = hi - lo + 1
        if count <= limit:
            return list(range(lo, hi + 1))
        if rng is not None:
            return sorted(rng.sample(range(lo, hi + 1), limit))
        return [lo + (i * (count - 1)) // max(limit - 1, 1) for i in range(limit)]

    @staticmethod
    def blocks(drafter: DFlashDrafter, target, seq, anchors: list[int]) -> torch.Tensor:
        """[A, block_size, hidden]: the drafter's outputs for blocks anchored at ``anchors``, all
        in one attention call: queries are every block's rows, keys [context ; all blocks];
        a row sees the context before its own anchor and its own block only."""
        bs, num = drafter.block_size, len(anchors)
        dev = drafter.fc.weight.device
        a = torch.tensor(anchors, dtype=torch.int64, device=dev)
        width = max(anchors)                                  # context rows any block reads
        ctx = drafter.context_kv(seq.aux[:width].to(dev)[None],
                                 torch.arange(width, device=dev)[None])
        x = drafter.block_input(target.model.embed_tokens, seq.token_ids.to(dev)[a])
        positions = (a[:, None] + torch.arange(bs, device=dev)).reshape(1, -1)
        row_anchor = a.repeat_interleave(bs)                  # [A * bs]
        row_block = torch.arange(num * bs, device=dev) // bs
        mask = torch.cat([torch.arange(width, device=dev)[None, :] < row_anchor[:, None],
                          row_block[:, None] == row_block[None, :]], dim=1)
        h = drafter(x.reshape(1, num * bs, -1), positions, ctx, mask[None])
        return h.view(num, bs, -1)

    # -- training ------------------------------------------------------------------------------
    def loss(self, drafter: DFlashDrafter, target, batch) -> tuple[torch.Tensor, dict]:
        rows, labels, weights = [], [], []
        decay = [math.exp(-(j - 1) / self.gamma) for j in range(drafter.block_size)]
        for seq in batch:
            # the global generator: the trainer seeds it per step (exact resumes)
            anchors = self._anchors(seq, self.per_sequence, random)
            if not anchors:
                continue
            h = self.blocks(drafter, target, seq, anchors)
            for b, a in enumerate(anchors):
                n = min(drafter.block_size - 1, seq.num_tokens - 1 - a)   # labelled rows 1..n
                rows.append(h[b, 1:1 + n])
                labels.append(seq.token_ids[a + 1:a + 1 + n])
                weights.extend(decay[1:1 + n])
        if not rows:
            raise ValueError("dflash: no continuation long enough to train on")
        ids = getattr(drafter, "draft_vocab_ids", None)
        logits = head_logits(target, torch.cat(rows), ids)
        labels = torch.cat(labels).to(logits.device)
        w = torch.tensor(weights, device=logits.device)
        if ids is not None:                   # rows of the draft vocabulary; others weigh 0
            labels = self._row_of(ids, target.args.vocab_size).to(labels.device)[labels]
            w = w * (labels >= 0)
            labels = labels.clamp(min=0)
        # a batch with no label in the draft vocabulary (rare) weighs nothing: a zero loss
        # with its graph, so the trainer's step goes on
        per_row = F.cross_entropy(logits, labels, reduction="none") * w
        loss = per_row.sum() / w.sum().clamp(min=1e-12)
        acc = ((logits.argmax(-1) == labels).float() * (w > 0)).sum() / (w > 0).sum().clamp(min=1)
        return loss, {"loss": float(loss.detach()), "acc": float(acc)}

    @torch.no_grad()
    def acceptance(self, drafter: DFlashDrafter, target, seqs, k: int) -> list[float]:
        """Held-out greedy acceptance: at up to 16 evenly spread anchors per sequence, draft a
        block over the draft vocabulary (as the proposer does) and count the leading drafts
        equal to the sequence's tokens. Entry j: the share
        of blocks whose drafts 1..j+1 all matched (0 past the block's block_size - 1 drafts)."""
        hits, total = [0] * k, 0
        n = min(k, drafter.block_size - 1)
        ids = getattr(drafter, "draft_vocab_ids", None)
        for seq in seqs:
            anchors = self._anchors(seq, 16)
            if not anchors:
                continue
            h = self.blocks(drafter, target, seq, anchors)[:, 1:1 + n]
            guesses = head_logits(target, h.reshape(-1, h.shape[-1]), ids).argmax(-1)
            if ids is not None:                   # draft-vocabulary rows -> target ids
                guesses = ids.to(guesses.device)[guesses]
            guesses = guesses.view(len(anchors), n).tolist()
            tokens = seq.token_ids.tolist()
            for a, guess in zip(anchors, guesses):
                total += 1
                for j in range(n):
                    if a + 1 + j >= len(tokens) or guess[j] != tokens[a + 1 + j]:
                        break
                    hits[j] += 1
        return [h / max(total, 1) for h in hits]

    def save(self, drafter: DFlashDrafter, target, out_dir: str) -> None:
        save_dflash(drafter, out_dir, vocab_size=target.args.vocab_size)
