"""Write quantized HF-style checkpoints other engines can read.

GPTQ (also used for RTN): AutoGPTQ's v1 layout (qweight / qzeros / scales / g_idx, zeros
stored minus one). AWQ: AutoAWQ's GEMM layout. FP8: ``weight`` float8_e4m3fn plus a
per-channel ``weight_scale`` [N, 1]. Scales are fp16 as those tools write them (our
quantizers already round scales to fp16, so nothing changes on the way out). Tensors that
are not quantized (embeddings, norms, an untied head) are kept in float32.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch
from safetensors.torch import save_file

from tokenmill.layers.quant.checkpoint_methods import awq_pack, pack_int32
from tokenmill.layers.quant.formats import Packed
from tokenmill.quantization.gptq import IntQuant


def gptq_tensors(prefix: str, qt: IntQuant) -> dict[str, torch.Tensor]:
    mask = (1 << qt.bits) - 1
    return {f"{prefix}.qweight": pack_int32(qt.q.t().contiguous(), qt.bits, dim=0),
            f"{prefix}.qzeros": pack_int32((qt.zero.t().long() - 1) & mask, qt.bits, dim=1),
            f"{prefix}.scales": qt.scale.t().contiguous().half(),
            f"{prefix}.g_idx": qt.g_idx.to(torch.int32)}


def awq_tensors(prefix: str, qt: IntQuant) -> dict[str, torch.Tensor]:
    return {f"{prefix}.qweight": awq_pack(qt.q.t().contiguous()),
            f"{prefix}.qzeros": awq_pack(qt.zero.t().contiguous().long()),
            f"{prefix}.scales": qt.scale.t().contiguous().half()}


def fp8_tensors(prefix: str, p: Packed) -> dict[str, torch.Tensor]:
    return {f"{prefix}.weight": p.qweight.view(torch.float8_e4m3fn),
            f"{prefix}.weight_scale": p.scales.reshape(-1, 1).float()}


def quantization_config(method: str, bits: int, group_size: int, sym: bool = False,
                        desc_act: bool = False, damp: float = 0.01,
                        static_groups: bool = False) -> dict:
    if method in ("gptq", "rtn"):
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym,
                "desc_act": desc_act, "damp_percent": damp, "static_groups": static_groups,
                "true_sequential": False, "checkpoint_format": "gptq", "lm_head": False,
                "tokenmill_method": method}
    if method == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group_size,
                "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
    if method == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_scale": "channel"}
    raise ValueError(f"unknown method {method!r}")


def write_checkpoint(out_dir: str, hf_config: dict, tensors: dict[str, torch.Tensor],
                     qconfig: dict, tokenizer=None) -> None:
    """tensors: every checkpoint tensor by name (quantized ones already in their layout)."""
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = dict(hf_config, quantization_config=qconfig, torch_dtype="float32")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if tokenizer is not None:
        write_tokenizer(out_dir, tokenizer)


def write_tokenizer(out_dir: str, tok) -> None:
    """tokenizer.json + tokenizer_config.json (also for a tokenizer read from GGUF metadata)."""
    tok.backend.save(os.path.join(out_dir, "tokenizer.json"))

    def name(i: Optional[int]):
        return tok.backend.id_to_token(i) if i is not None else None
    cfg = {"bos_token": name(tok.bos_token_id), "eos_token": name(tok.eos_token_id),
           "pad_token": name(tok.pad_token_id), "unk_token": name(tok.unk_token_id),
           "add_bos_token": bool(getattr(tok, "_prepend_bos", False)),
           "chat_template": tok.chat_template}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({k: v for k, v in cfg.items() if v is not None}, f, indent=2)
