"""`tokenmill quantize`: float checkpoint -> quantized HF-style checkpoint directory.

The float weights are the checkpoint's own (for a GGUF model: dequantized to float32, the
baseline). Calibration (GPTQ / AWQ) uses the ShareGPT calibration split only; evaluation
uses a disjoint split (``tokenmill eval ppl``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Optional

import torch

from tokenmill.layers.quant import formats
from tokenmill.quantization import writer
from tokenmill.quantization.gptq import gptq, rtn


@dataclass(frozen=True)
class QuantizeArgs:
    model: str
    method: str            # rtn | gptq | awq | fp8
    output: str
    bits: int = 4
    group_size: int = 128
    calib_samples: int = 64
    seq_len: int = 512
    act_order: bool = True
    static_groups: bool = False
    damp: float = 0.01
    cache_dir: Optional[str] = None

    def __post_init__(self) -> None:
        if self.method not in ("rtn", "gptq", "awq", "fp8"):
            raise ValueError(f"method must be rtn, gptq, awq or fp8, got {self.method!r}")
        if self.method != "fp8" and self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.method == "awq" and self.bits != 4:
            raise ValueError("AWQ writes 4-bit weights only")


def linear_prefixes(model: torch.nn.Module) -> dict[str, str]:
    """Checkpoint module prefix (q_proj, ...) -> the engine's (possibly fused) module name."""
    from tokenmill.layers.linear import Linear
    stacked = getattr(model, "stacked_params", {})
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or name.endswith("lm_head"):
            continue
        base = name + "."
        shards = [base.replace(fused, frag)[:-1] for frag, (fused, _) in stacked.items() if fused in base]
        for prefix in shards or [name]:
            out[prefix] = name
    return out


def quantize(a: QuantizeArgs, log=print) -> str:
    from tokenmill import LLM
    t0 = time.time()
    llm = LLM(model=a.model, cache_dir=a.cache_dir, enable_prefix_caching=False,
              max_model_len=a.seq_len + 8, max_num_batched_tokens=max(2048, a.seq_len + 8))
    engine = llm.engine
    from tokenmill.models.loader import open_checkpoint
    ckpt = open_checkpoint(engine.model_path)
    tensors = dict(ckpt.iter_tensors())
    prefixes = linear_prefixes(engine.model)
    a = replace(a, group_size=common_group(tensors, prefixes, a.group_size))
    stats = None
    if a.method in ("gptq", "awq"):
        from tokenmill.quantization.calibration import collect, text_token_windows
        windows = text_token_windows(engine.tokenizer, "calibration", a.calib_samples, a.seq_len, a.cache_dir)
        stats = collect(engine, windows, hessian=a.method == "gptq",
                        sample_rows=256 if a.method == "awq" else 0)   # AWQ search cost ~ rows
        log(f"calibrated on {a.calib_samples} x {a.seq_len} tokens in {time.time() - t0:.0f}s")
    out = _quantize_tensors(a, tensors, prefixes, stats, engine.model)
    qc = writer.quantization_config(a.method, a.bits, a.group_size if a.group_size > 0 else -1,
                                    sym=a.bits == 8, desc_act=a.act_order and a.method == "gptq",
                                    static_groups=a.static_groups and a.method == "gptq", damp=a.damp)
    cfg = {k: v for k, v in ckpt.hf_config.items() if k != "quantization_config"}
    writer.write_checkpoint(a.output, cfg, out, qc, engine.tokenizer)
    log(f"wrote {a.output} ({a.method}, {a.bits} bits, group {a.group_size}) in {time.time() - t0:.0f}s")
    return a.output


def _quantize_tensors(a: QuantizeArgs, tensors: dict, prefixes: dict, stats, model) -> dict:
    out: dict[str, torch.Tensor] = {}
    if a.method == "awq":
        inputs = {name: stats.sample(name) for name in stats.samples}
        for i in range(model.args.num_hidden_layers):
            for prefix, qt in _awq(tensors, f"model.layers.{i}", inputs, a).items():
                out.update(writer.awq_tensors(prefix, qt))
    for prefix, module in prefixes.items():
        if prefix + ".weight" not in tensors:
            continue
        w = tensors.pop(prefix + ".weight")
        group = a.group_size if a.group_size > 0 else w.shape[1]
        if a.method == "fp8":
            out.update(writer.fp8_tensors(prefix, formats.quantize_fp8(w)))
            continue
        if a.method == "gptq":
            qt = gptq(w, stats.hessians[module].value(), a.bits, group, sym=a.bits == 8,
                      damp=a.damp, act_order=a.act_order, static_groups=a.static_groups)
        else:
            qt = rtn(w, a.bits, group, sym=a.bits == 8)
        out.update(writer.gptq_tensors(prefix, qt))
    out.update(tensors)   # embeddings, norms, an untied head: float
    return out


def common_group(tensors: dict, prefixes: dict, wanted: int) -> int:
    """Checkpoint formats carry one group size: the wanted one, else the largest of
    128 / 64 / 32 below it dividing every quantized input width (-1 stays per-channel)."""
    if wanted <= 0:
        return -1
    widths = {tensors[p + ".weight"].shape[1] for p in prefixes if p + ".weight" in tensors}
    for g in (wanted, 128, 64, 32):
        if g <= wanted and all(k % g == 0 for k in widths):
            return g
    raise ValueError(f"no group size <= {wanted} divides every input width {sorted(widths)}")


def _awq(tensors: dict, layer: str, inputs: dict, a: QuantizeArgs) -> dict:
    from tokenmill.quantization.awq import awq_layer
    return awq_layer(tensors, layer, inputs, a.bits, a.group_size)
