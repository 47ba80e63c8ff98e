"""Checkpoint -> ready model on a device."""
from __future__ import annotations

import torch

from tokenmill.models.registry import model_class
from tokenmill.models.weights import load_weights


def build_model(checkpoint, device: torch.device, dtype: torch.dtype,
                max_model_len: int) -> torch.nn.Module:
    cfg = dict(checkpoint.hf_config)
    # RoPE tables only need to cover the context we serve.
    cfg["max_position_embeddings"] = max(max_model_len, 1)
    cls = model_class(cfg)
    with torch.device(device):
        model = cls(cfg)
    load_weights(model, checkpoint.iter_tensors())
    model.to(dtype=dtype)
    model.eval()
    return model
