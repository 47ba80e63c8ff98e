"""GGUF Q8_0 / Q4_0 / Q4_1 tensors repacked for the quantized matmul instead of expanded.

Q4_0 / Q4_1 nibbles are already in our int4 layout, so repacking copies bytes and turns the
fp16 block fields into float32 scales / mins (Q4_0: min = -8 * d); Q8_0 becomes int8 values
with per-block scales. Rows keep the same fix-up (llama q/k RoPE order) as the float path.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from tokenmill.models.loader import gguf_llama
from tokenmill.models.loader.gguf_quants import ggml_type

PACKABLE = ("Q8_0", "Q4_0", "Q4_1")


def tensor_types(checkpoint) -> dict[str, str]:
    """HF weight name -> GGML type name, for every tensor HF has a parameter for."""
    arch = gguf_llama.architecture(checkpoint.gguf)
    types = {}
    for gguf_name, info in checkpoint.gguf.tensors.items():
        name = gguf_llama.hf_name(gguf_name, arch)
        if name is not None:
            types[name] = info.type_name
    return types


def repack(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """Raw bytes of one [N, K] tensor -> {"qweight", "scales"[, "mins"]} (numpy, rows first)."""
    n, k = shape
    t = ggml_type({"Q8_0": 8, "Q4_0": 2, "Q4_1": 3}[type_name])
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // 32, t.type_size)

    def f16(start: int) -> np.ndarray:
        return np.ascontiguousarray(blocks[:, :, start:start + 2]).view(np.float16)[..., 0].astype(np.float32)

    d = f16(0)
    if type_name == "Q8_0":
        q = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(n, k)
        return {"qweight": q, "scales": d}
    if type_name == "Q4_0":
        return {"qweight": blocks[:, :, 2:].reshape(n, k // 2), "scales": d, "mins": -8.0 * d}
    return {"qweight": blocks[:, :, 4:].reshape(n, k // 2), "scales": d, "mins": f16(2)}


def iter_tensors(checkpoint, plan: dict[str, tuple[list[str], bool]],
                 lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Like ``checkpoint.iter_tensors()``, but each weight named in ``plan`` comes packed:
    ``{prefix}.qweight`` / ``.scales`` / ``.mins`` for every target prefix, plus the float
    tensor when something (a tied embedding) still needs it (lazy: as a LazyTensor)."""
    gguf, cfg = checkpoint.gguf, checkpoint.hf_config
    arch = gguf_llama.architecture(gguf)
    for gguf_name, info in gguf.tensors.items():
        name = gguf_llama.hf_name(gguf_name, arch)
        targets, also_float = plan.get(name, ([], True))
        if also_float and lazy:
            converted = gguf_llama.lazy_hf_tensor(gguf, cfg, gguf_name)
            if converted is not None:
                yield converted
        elif also_float:
            converted = gguf_llama.hf_tensor(gguf, cfg, gguf_name)
            if converted is not None:
                yield converted[0], torch.from_numpy(converted[1])
        if not targets:
            continue
        parts = repack(gguf.raw(gguf_name), info.type_name, info.shape)
        parts = {key: _fix_rows(gguf_name, arch, cfg, value) for key, value in parts.items()}
        for prefix in targets:
            for key, value in parts.items():
                yield f"{prefix}.{key}", torch.from_numpy(np.ascontiguousarray(value))


def _fix_rows(gguf_name: str, arch: str, cfg: dict, values: np.ndarray) -> np.ndarray:
    """The q/k row un-permutation of ``gguf_llama.hf_tensor``, applied to packed rows."""
    kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
    if gguf_llama.ARCHS[arch].permuted_qk and kind in ("attn_q", "attn_k"):
        heads = cfg["num_attention_heads"] if kind == "attn_q" else cfg["num_key_value_heads"]
        return gguf_llama.unpermute_rope_rows(values, heads)
    return values
