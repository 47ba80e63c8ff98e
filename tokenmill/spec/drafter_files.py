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
