"""Architecture name (HF ``architectures``) -> model class."""
from __future__ import annotations

from torch import nn

from tokenmill.models.llama import LlamaForCausalLM

_MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(hf_config: dict) -> type[nn.Module]:
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in _MODELS:
            return _MODELS[arch]
    if not archs and hf_config.get("model_type") == "llama":
        return LlamaForCausalLM
    raise ValueError(f"model architecture {archs or hf_config.get('model_type')!r} is not supported; "
                     f"supported: {', '.join(supported_architectures())}")
