"""The target's LM head as a drafter that shares it uses it: restricted, when the drafter
names one, to a draft vocabulary (the tokens it may propose, e.g. the most frequent ones of
its training data). On a CPU the full head is the largest read of a draft step (SmolLM2:
49152 x 576 floats, more than the drafter's own layers); 8192 rows cost a sixth of it. A
draft is only a guess, so a token outside the set costs acceptance, never exactness."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tokenmill.layers import cpu_ops, prepacked


class DraftHead:
    def __init__(self, target, token_ids: Optional[torch.Tensor]) -> None:
        self.target = target
        w = prepacked.dense_weight(target.lm_head)   # bf16 mode: read back from the tiles
        usable = isinstance(w, torch.Tensor) and w.is_floating_point()
        if token_ids is not None and usable and token_ids.numel() < w.shape[0]:
            self.token_ids = token_ids.to(device=w.device, dtype=torch.int64)
            self.weight = w.detach()[self.token_ids].contiguous()   # [draft vocab, hidden]
        else:   # the whole vocabulary, through the serving head (packed weights included)
            self.token_ids, self.weight = None, None

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (post-norm) -> [N] target token ids. Soft-capping is monotonic,
        so the argmax of the raw logits is the capped logits' argmax."""
        return self.to_target(self.logits(hidden).argmax(-1))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (post-norm) -> [N, draft vocab] logits (the serving head's over
        the whole vocabulary when there is no draft vocabulary)."""
        if self.weight is None:
            return self.target.compute_logits(hidden)
        if self.weight.dtype in cpu_ops.HALF_WEIGHT_CODES and hidden.dtype is torch.float32:
            x = hidden.contiguous()   # a 16-bit head of float32 activations (quantization bf16 / fp16)
            logits = cpu_ops.linear_half(x, self.weight)
            return F.linear(x, self.weight.to(x.dtype)) if logits is None else logits
        x = hidden.to(self.weight.dtype).contiguous()
        logits = cpu_ops.linear(x, self.weight)   # decode-sized rows: the streaming kernel
        return F.linear(x, self.weight) if logits is None else logits

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.token_ids is None else self.token_ids[draft_ids]
