"""GGUF Q8_0 / Q4_0 / Q4_1 tensors repacked for the quantized matmul instead of expanded.

Q4_0 / Q4_1 nibbles are already in our int4 layout, so repacking copies bytes and turns the
fp16 block fields into float32 scales / mins (Q4_0: min = -8 * d); Q8_0 becomes int8 values
with per-block scales. Rows keep the same fix-up (llama q/k RoPE order) as the float path,
and a stacked expert tensor is repacked one expert (one HF weight name) at a time.
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
    num_experts = gguf_llama.num_experts(checkpoint.hf_config)
    types = {}
    for gguf_name, info in checkpoint.gguf.tensors.items():
        for name, _ in gguf_llama.hf_names(gguf_name, arch, num_experts):
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
    arch, num_experts = gguf_llama.architecture(gguf), gguf_llama.num_experts(cfg)
    for gguf_name, info in gguf.tensors.items():
        parts = gguf_llama.hf_names(gguf_name, arch, num_experts)
        floats = {name for name, _ in parts if plan.get(name, ([], True))[1]}
        if floats:
            convert = gguf_llama.lazy_hf_tensors if lazy else _float_tensors
            yield from ((name, t) for name, t in convert(gguf, cfg, gguf_name) if name in floats)
        heads = gguf_llama.rope_heads(arch, cfg, gguf_name)
        for name, expert in parts:
            targets = plan.get(name, ([], True))[0]
            if not targets:
                continue
            raw, shape = gguf_llama.raw_part(gguf, gguf_name, expert)
            packed = repack(raw, info.type_name, shape)
            if heads:  # the q/k row un-permutation of the float path, on packed rows
                packed = {key: gguf_llama.unpermute_rope_rows(value, heads) for key, value in packed.items()}
            for prefix in targets:
                for key, value in packed.items():
                    yield f"{prefix}.{key}", torch.from_numpy(np.ascontiguousarray(value))


def _float_tensors(gguf, cfg: dict, gguf_name: str) -> Iterator[tuple[str, torch.Tensor]]:
    for name, values in gguf_llama.hf_tensors(gguf, cfg, gguf_name):
        yield name, torch.from_numpy(values)
