"""Weight quantization as a strategy on each ``Linear``.

``QuantSpec`` names a scheme; ``attach_quantization(model, spec)`` sets the matching strategy on
every Linear before loading (by module name, so model files stay scheme-free), and
``process_weights_after_loading(model)`` lets each strategy repack what it loaded.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from torch import nn

from tokenmill.layers.quant.methods import (HALF_DTYPES, FP8Method, HalfWeightMethod, Int4Method,
                                            Int8Method, LinearMethod, UnquantizedLinearMethod)

ONLINE_METHODS = ("int8", "int4", "fp8") + tuple(HALF_DTYPES)
CHECKPOINT_METHODS = ("gptq", "awq", "fp8-ckpt", "gguf")
_INT4_RE = re.compile(r"int4(?:-g(\d+))?")


@dataclass(frozen=True)
class QuantSpec:
    """method: "none" | "int8" | "int4" | "fp8" (online RTN from float weights) | "bf16" |
    "fp16" (16-bit weights, float32 activations) |
    "gptq" | "awq" | "fp8-ckpt" (pre-quantized checkpoints) | "gguf" (GGUF quants repacked).
    ``config``: the checkpoint's ``quantization_config`` (or the GGUF tensor types);
    ``skip``: module-name fragments left unquantized."""

    method: str = "none"
    group_size: int = 64
    config: dict = field(default_factory=dict)
    skip: tuple[str, ...] = ()
    use_kernel: bool = True

    def __post_init__(self) -> None:
        if self.method not in ("none",) + ONLINE_METHODS + CHECKPOINT_METHODS:
            raise ValueError(f"unknown quantization method {self.method!r}")


def parse_quantization(name: Optional[str]) -> QuantSpec:
    """A user spelling ("int8", "int4", "int4-g32", "fp8", "bf16", "fp16", "none") -> QuantSpec."""
    if name in (None, "", "none"):
        return QuantSpec()
    m = _INT4_RE.fullmatch(name)
    if m:
        return QuantSpec("int4", group_size=int(m.group(1) or 64))
    if name in ("int8", "fp8", "gguf") + tuple(HALF_DTYPES):
        return QuantSpec(name)
    raise ValueError(f"unknown quantization {name!r}; choose none, int8, int4, int4-g32, "
                     f"int4-g64, int4-g128, fp8, bf16, fp16 or gguf (GPTQ / AWQ / FP8 checkpoints "
                     f"are recognised from their config)")


def method_for(spec: QuantSpec, module_name: str, layer: nn.Module,
               sources: Optional[list[str]] = None, tied: bool = False) -> LinearMethod:
    """The strategy for one Linear; ``sources``: the checkpoint weights it is built from;
    ``tied``: the layer shares its weight with the embedding."""
    if tied and module_name.endswith("lm_head") and spec.method in ("gptq", "awq") \
            and not spec.config.get("lm_head"):
        # The checkpoint keeps the tied head float; next to 4-bit linears that one matrix
        # would be most of the model (SmolLM2-135M: 113 of 180 MB). int8 RTN of it (the
        # embedding then reads its rows from the packed head) costs little perplexity.
        return Int8Method(use_kernel=spec.use_kernel)
    if spec.method == "none" or any(s in module_name for s in spec.skip):
        return UnquantizedLinearMethod()
    if spec.method == "int8":
        return Int8Method(use_kernel=spec.use_kernel)
    if spec.method == "int4" and module_name.endswith("lm_head"):
        # The head is the most error-sensitive matmul (SmolLM2, 1020 ShareGPT tokens: ppl 37.5
        # with an int4 head, 31.1 with an int8 one or a float one); int8 keeps it cheap.
        return Int8Method(use_kernel=spec.use_kernel)
    if spec.method == "int4":
        if layer.in_features % 32:
            # The nibble layout packs 32 inputs per block; a narrower or ragged input (a
            # small MoE expert's down_proj, say) would not pack: int8 keeps it quantized.
            return Int8Method(use_kernel=spec.use_kernel)
        return Int4Method(spec.group_size, use_kernel=spec.use_kernel)
    if spec.method == "fp8":
        return FP8Method(use_kernel=spec.use_kernel)
    if spec.method in HALF_DTYPES:
        return HalfWeightMethod(spec.method)
    from tokenmill.layers.quant import checkpoint_methods
    return checkpoint_methods.method_for(spec, module_name, layer, sources or [])


PackPlan = dict   # checkpoint weight name -> (module prefixes that take it packed, float too?)


def attach_quantization(model: nn.Module, spec: QuantSpec) -> PackPlan:
    """Give every Linear of ``model`` its strategy; call before loading weights. Returns,
    for GGUF, which checkpoint weights to deliver packed and under which module names."""
    from tokenmill.layers.linear import Linear
    if spec.method == "none":
        return {}
    names_by_id: dict[int, list[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        names_by_id.setdefault(id(p), []).append(pname)
    stacked = getattr(model, "stacked_params", {})
    targets: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        old = getattr(module, "weight", None)
        sources = _sources(name, old, names_by_id, stacked)
        module.set_quant_method(method_for(spec, name, module, sources, _tied(old, names_by_id)))
        _keep_tie(module, old, names_by_id)
        if "qweight" in module.quant_param_names and spec.method == "gguf":
            for src in sources:   # a tied head takes its twin's blocks under its own name
                prefix = name if _tied(old, names_by_id) else src[:-len(".weight")]
                targets.setdefault(src, []).append(prefix)
    if spec.method == "gguf":
        from tokenmill.layers.quant.embedding import embed_from_packed_head
        embed_from_packed_head(model)   # the tied embedding's float table is then never read
    floats = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return {src: (prefixes, src in floats) for src, prefixes in targets.items()}


def _tied(old, names_by_id) -> bool:
    return old is not None and len(names_by_id.get(id(old), [])) > 1


def _sources(name: str, old, names_by_id: dict, stacked: dict) -> list[str]:
    """Checkpoint weight names a Linear is loaded from: fused shards expand, a tied head
    reads its twin (the embedding)."""
    if _tied(old, names_by_id):
        return [n for n in names_by_id[id(old)] if not n.startswith(name + ".")]
    base = name + "."
    fused = [base.replace(f, frag) + "weight" for frag, (f, _) in stacked.items() if f in base]
    return fused or [name + ".weight"]


def _keep_tie(module: nn.Module, old, names_by_id: dict) -> None:
    """A tied head (weight shared with the embedding) must keep the shared tensor when the
    new strategy loads float weights: the checkpoint fills it only through the embedding."""
    new = getattr(module, "weight", None)
    if not _tied(old, names_by_id) or new is None:
        return
    if new.shape == old.shape and new.dtype == old.dtype:
        module.weight = old


def process_weights_after_loading(model: nn.Module) -> None:
    from tokenmill.layers.linear import Linear
    for module in model.modules():
        if isinstance(module, Linear):
            module.quant_method.process_weights_after_loading(module)


def resolve_quant_spec(requested: Optional[str], checkpoint) -> QuantSpec:
    """The scheme to run: a quantized checkpoint's own (GPTQ / AWQ / FP8 config), GGUF
    quants kept packed, or online RTN of float weights as requested."""
    qc = checkpoint.hf_config.get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method"):
        method = {"fp8": "fp8-ckpt"}.get(qc["quant_method"], qc["quant_method"])
        if method not in CHECKPOINT_METHODS:
            raise ValueError(f"checkpoint quantization {qc['quant_method']!r} is not supported")
        if requested not in (None, "none", qc["quant_method"], method):
            raise ValueError(f"{checkpoint.path} is already quantized ({qc['quant_method']}); "
                             f"it cannot be re-quantized as {requested!r}")
        skip = tuple(qc.get("modules_to_not_convert") or ()) + (() if qc.get("lm_head") else ("lm_head",))
        return QuantSpec(method, config=dict(qc), skip=skip)
    if requested == "gguf":
        if not hasattr(checkpoint, "gguf"):
            raise ValueError("quantization='gguf' needs a .gguf checkpoint")
        from tokenmill.layers.quant import gguf
        return QuantSpec("gguf", config={"types": gguf.tensor_types(checkpoint)})
    return parse_quantization(requested)


def checkpoint_tensors(checkpoint, spec: QuantSpec, plan: PackPlan, lazy: bool = False):
    """The tensors to load: packed GGUF blocks where the plan says so, else the usual ones.
    ``lazy``: safetensors come as LazyTensors that loaders narrow before reading."""
    if spec.method == "gguf" and plan:
        from tokenmill.layers.quant import gguf
        return gguf.iter_tensors(checkpoint, plan, lazy=lazy)
    return checkpoint.iter_tensors(lazy=lazy)
