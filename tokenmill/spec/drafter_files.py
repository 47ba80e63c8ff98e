"""Reading a drafter checkpoint directory (config.json + *.safetensors), the layout every
published drafter format here shares (Medusa, EAGLE, EAGLE-3, DFlash)."""
from __future__ import annotations

import json
import os


def read_drafter_dir(path: str) -> tuple[dict, dict]:
    """(config, {name: tensor} over every .safetensors file in the directory)."""
    from safetensors.torch import load_file
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {path} "
                                "(convert a pytorch_model.bin to safetensors first)")
    tensors: dict = {}
    for name in files:
        tensors.update(load_file(os.path.join(path, name)))
    return cfg, tensors


def load_checked_state(module, state: dict, path: str, kind: str) -> None:
    """``module.load_state_dict(state)`` after checking names and shapes, with an error that
    says which checkpoint is not a ``kind`` and why (strict loading's message names neither)."""
    own = module.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"{path}: not {kind} checkpoint: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    bad = [n for n, t in state.items() if tuple(t.shape) != tuple(own[n].shape)]
    if bad:
        raise ValueError(f"{path}: {bad[0]} has shape {tuple(state[bad[0]].shape)}, the config "
                         f"says {tuple(own[bad[0]].shape)}")
    module.load_state_dict(state)
