"""Architecture name (HF ``architectures``, else ``model_type``) -> model class."""
from __future__ import annotations

from torch import nn

from tokenmill.models.gemma3 import Gemma3ForCausalLM
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.mistral import MistralForCausalLM
from tokenmill.models.mixtral import MixtralForCausalLM
from tokenmill.models.olmoe import OlmoeForCausalLM
from tokenmill.models.qwen2 import Qwen2ForCausalLM
from tokenmill.models.qwen3 import Qwen3ForCausalLM
from tokenmill.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

_MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
}
# Configs without ``architectures`` (hand-written ones) name only a model type.
_MODEL_TYPES = {
    "llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM, "gemma3_text": Gemma3ForCausalLM, "mixtral": MixtralForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM, "olmoe": OlmoeForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(hf_config: dict) -> type[nn.Module]:
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in _MODELS:
            return _MODELS[arch]
    if not archs and hf_config.get("model_type") in _MODEL_TYPES:
        return _MODEL_TYPES[hf_config["model_type"]]
    raise ValueError(f"model architecture {archs or hf_config.get('model_type')!r} is not supported; "
                     f"supported: {', '.join(supported_architectures())}")


def check_parallel_layout(hf_config: dict, tp_size: int, expert_parallel: bool = False) -> None:
    """Fail before any rank process starts when the model does not split this way."""
    from tokenmill.models.llama import check_tensor_parallel
    check_tensor_parallel(model_class(hf_config).make_args(hf_config), tp_size, expert_parallel)
