"""Copy checkpoint tensors into a model through each parameter's ``weight_loader``.

Fused parameters are declared by the model class in ``stacked_params``; a missing or
misshaped tensor raises an error naming it."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from tokenmill.layers.lazy import LazyTensor, Owned, materialize

# Buffers some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_weights(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(getattr(model, "args", None), "tie_word_embeddings", False)
    stacked = getattr(model, "stacked_params", {})
    skips = getattr(model, "skips_checkpoint_tensor", None)   # another rank's experts
    expected = _expected_sources(params, stacked, tied)
    seen: set[str] = set()
    for name, tensor in tensors:
        owned = isinstance(tensor, Owned)
        if owned:
            tensor = tensor.tensor
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if tied and name == "lm_head.weight":
            continue   # tied head: the embedding is the head
        if skips is not None and skips(name):
            continue
        target, shard = _target(name, stacked)
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter")
        loader = getattr(param, "weight_loader", None)
        if not getattr(loader, "accepts_lazy", False):
            tensor = materialize(tensor)
        if loader is None:
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)}")
            param.data.copy_(tensor)
        else:
            handover = {"owned": True} if owned and getattr(loader, "accepts_owned", False) else {}
            loader(param, tensor if isinstance(tensor, LazyTensor) else tensor.to(param.dtype),
                   shard, name=name, **handover)
        seen.add(name)
    missing = sorted(expected - seen)
    if missing:
        raise ValueError(f"checkpoint is missing tensor(s): {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))


def _target(name: str, stacked: dict) -> tuple[str, object]:
    for fragment, (fused, shard) in stacked.items():
        if fragment in name:
            return name.replace(fragment, fused), shard
    return name, None


def _expected_sources(params: dict, stacked: dict, tied: bool) -> set[str]:
    """Checkpoint names the model needs: fused parameters expand to their shards."""
    names = set()
    for pname in params:
        if tied and pname == "lm_head.weight":
            continue
        expanded = [pname.replace(fused, frag) for frag, (fused, _) in stacked.items() if fused in pname]
        names.update(expanded or [pname])
    return names


def randomize_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Random weights in place of a checkpoint's (load_format="dummy"): matrices (linears,
    embeddings) N(0, std), biases 0; norm weights keep the values their modules start with.
    Online quantization then packs these like loaded weights."""
    generator = None
    for name, param in model.named_parameters():
        if generator is None or generator.device != param.device:
            generator = torch.Generator(device=param.device)
            generator.manual_seed(seed)
        if param.dim() >= 2 and param.is_floating_point():
            param.data.normal_(0.0, std, generator=generator)
        elif name.endswith("bias"):
            param.data.zero_()
