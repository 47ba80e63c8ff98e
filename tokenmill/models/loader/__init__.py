"""Checkpoint loaders: one interface over HF safetensors directories and GGUF files.

A Checkpoint is an HF-style config dict plus an iterator of (HF parameter name, float32
tensor in HF layout). Model code never sees which file format the weights came from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ...tokenizer import Tokenizer
from . import gguf_llama, hf_dir
from .errors import CheckpointError
from .gguf_reader import GGUFFile
from .gguf_tokenizer import gguf_tokenizer

__all__ = ["Checkpoint", "CheckpointError", "GGUFCheckpoint", "HFCheckpoint", "open_checkpoint", "load_tokenizer"]


@dataclass
class Checkpoint:
    """hf_config: an HF config.json dict; path: the directory or .gguf file."""

    hf_config: dict
    path: str
    random_weights: bool = field(default=False, kw_only=True)   # load_format="dummy"

    def iter_tensors(self, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF parameter name, float32 tensor in HF layout), one tensor in memory at a time.
        ``lazy``: LazyTensors where the format can read a slice alone (safetensors)."""
        raise NotImplementedError

    def weight_bytes(self) -> int:
        """Bytes of the tensors as stored on disk (quantized size for GGUF)."""
        raise NotImplementedError

    def release_pages(self) -> None:
        """After loading: give back memory-mapped file pages still counted as resident."""


@dataclass
class HFCheckpoint(Checkpoint):
    files: list[str] = field(default_factory=list)

    def iter_tensors(self, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        return hf_dir.iter_safetensors(self.files, lazy=lazy)

    def weight_bytes(self) -> int:
        return sum(hf_dir.data_bytes(f) for f in self.files)


@dataclass
class GGUFCheckpoint(Checkpoint):
    gguf: GGUFFile = field(default=None, repr=False)  # type: ignore[assignment]

    def iter_tensors(self, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        # Per-architecture fix-ups (q/k row order, Gemma norm offsets, one tensor per expert
        # out of a stacked one) live in gguf_llama.
        for gguf_name in self.gguf.tensors:
            if lazy:
                yield from gguf_llama.lazy_hf_tensors(self.gguf, self.hf_config, gguf_name)
                continue
            for name, values in gguf_llama.hf_tensors(self.gguf, self.hf_config, gguf_name):
                yield name, torch.from_numpy(values)
            self.gguf.release_tensor(gguf_name)   # its values were copied out

    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.gguf.tensors.values())

    def release_pages(self) -> None:
        self.gguf.release_pages()   # the whole file was read through its mapping


def _is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def open_checkpoint(path: str, load_format: str = "auto") -> Checkpoint:
    """Open a directory (config.json + safetensors) or a .gguf file; reads metadata only.
    ``load_format="dummy"``: a directory's config.json alone; the model gets random weights
    (models/weights.py randomize_weights), for speed measurements at any model size."""
    if load_format == "dummy":
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: load_format='dummy' needs a directory with a config.json")
        return HFCheckpoint(hf_config=hf_dir.hf_config(path), path=path, files=[],
                            random_weights=True)
    if load_format != "auto":
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    if _is_gguf(path):
        gguf = GGUFFile(path)
        config = gguf_llama.hf_config(gguf)
        gguf_llama.check_tensors(gguf, config)  # fail now, not halfway through loading
        return GGUFCheckpoint(hf_config=config, path=path, gguf=gguf)
    if os.path.isdir(path):
        return HFCheckpoint(hf_config=hf_dir.hf_config(path), path=path, files=hf_dir.safetensors_files(path))
    raise CheckpointError(f"{path}: not a model directory or an existing .gguf file")


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of a model directory (tokenizer.json) or a .gguf file (its metadata)."""
    if _is_gguf(path):
        return gguf_tokenizer(GGUFFile(path))
    if os.path.isdir(path):
        return hf_dir.hf_tokenizer(path)
    raise CheckpointError(f"{path}: not a model directory or an existing .gguf file")
