"""The target's head as training needs it: differentiable with respect to its input.

The serving path's ``compute_logits`` may run a prepacked oneDNN linear or a packed
quantized kernel, which autograd cannot go through (the gradient silently stops there), so
recipes that train something *below* the target's frozen LM head call ``head_logits``."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def head_weight(target) -> torch.Tensor:
    from tokenmill.layers import prepacked
    w = prepacked.dense_weight(target.lm_head)   # bf16 mode: its rounded values, read back
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise ValueError("training a drafter needs the target's LM head in floating point; "
                         "load the target without quantization")
    return w


def head_logits(target, hidden: torch.Tensor, ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """hidden [N, H] -> float32 logits [N, V], as ``target.compute_logits`` (final logit
    soft-capping included), with gradients flowing to ``hidden``. ``ids``: only the logits
    of these token ids, [N, len(ids)] (a drafter's draft vocabulary)."""
    w = head_weight(target)
    if ids is not None:
        w = w[ids.to(w.device)]
    logits = F.linear(hidden.to(w.dtype), w).float()
    cap = getattr(target.args, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits
