"""A distilled draft model: a student of the target's first ``num_layers`` layers (copied, then
trained) + its final norm, sharing the target's embedding and LM head (frozen), trained to
match the target's next-token distribution (KL at temperature 1) on the target's own
continuations. Saved as a plain HF Llama directory, served through ``draft_model``."""
from __future__ import annotations

import json
import os
import random

import torch
import torch.nn.functional as F

from tokenmill.spec.shallow import llama_config
from tokenmill.spec.train.dense_llama import DenseLlama
from tokenmill.spec.train.target_ops import head_logits, head_weight


class DistillRecipe:
    method = "draft-model"

    def aux_layers(self, target) -> tuple[int, ...]:
        return ()

    def build(self, target, options: dict, seed: int, data=None) -> DenseLlama:
        self.max_len = int(options.get("max_sequence_tokens", 384))
        self.positions = int(options.get("positions_per_sequence", 96))
        return DenseLlama.from_target(target, int(options.get("num_layers", 6)))

    def _student_hidden(self, student: DenseLlama, target, seq) -> torch.Tensor:
        ids = seq.token_ids[:self.max_len]
        with torch.no_grad():
            x = target.model.embed_tokens(ids).float()
        return student(x)

    def _rows(self, seq, limit: int) -> torch.Tensor:
        """Positions whose next token is a continuation token (inside the length cap)."""
        rows = list(range(max(seq.prompt_len - 1, 0), min(seq.num_tokens, self.max_len) - 1))
        if len(rows) > limit:
            rows = sorted(random.sample(rows, limit))
        return torch.tensor(rows, dtype=torch.int64)

    def loss(self, student: DenseLlama, target, batch) -> tuple[torch.Tensor, dict]:
        losses, correct, count = [], 0, 0
        for seq in batch:
            rows = self._rows(seq, self.positions)
            if rows.numel() == 0:
                continue
            logp = F.log_softmax(head_logits(target, self._student_hidden(student, target, seq)[rows]), -1)
            with torch.no_grad():
                teacher = F.log_softmax(head_logits(target, seq.final[rows]), -1)
            losses.append(F.kl_div(logp, teacher, log_target=True, reduction="batchmean"))
            correct += int((logp.argmax(-1) == teacher.argmax(-1)).sum())
            count += rows.numel()
        if not losses:
            raise ValueError("draft-model: no continuation to train on")
        loss = torch.stack(losses).mean()
        return loss, {"loss": loss.item(), "acc": correct / max(count, 1)}

    @torch.no_grad()
    def acceptance(self, student: DenseLlama, target, seqs, k: int) -> list[float]:
        """Greedy chains are exactly teacher forcing while they are right: a chain from
        position p is accepted through j when the student's argmax matches the target's
        token at p + 1 .. p + 1 + j, each given the true prefix."""
        hits, total = [0] * k, 0
        for seq in seqs:
            n = min(seq.num_tokens, self.max_len)
            right = (head_logits(target, self._student_hidden(student, target, seq)).argmax(-1)[:n - 1]
                     == seq.token_ids[1:n])
            for p in range(max(seq.prompt_len, 1), n - 1):   # the newest token is at p
                total += 1
                for j in range(k):
                    if p + j >= n - 1 or not right[p + j]:
                        break
                    hits[j] += 1
        return [h / max(total, 1) for h in hits]

    def save(self, student: DenseLlama, target, out_dir: str) -> None:
        """An HF Llama directory (config.json + model.safetensors) with the target's
        embedding (and head, when the target does not tie them)."""
        from safetensors.torch import save_file
        a = target.args
        tensors = {k: v.detach().float().contiguous() for k, v in student.state_dict().items()}
        tensors["model.embed_tokens.weight"] = target.model.embed_tokens.weight.detach().float().contiguous()
        if not a.tie_word_embeddings:
            tensors["lm_head.weight"] = head_weight(target).detach().float().contiguous()
        os.makedirs(out_dir, exist_ok=True)
        save_file(tensors, os.path.join(out_dir, "model.safetensors"))
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(llama_config(a, student.num_layers), f, indent=1)
