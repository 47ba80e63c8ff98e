"""GGUF block quants repacked for the quantized matmul instead of expanded to floats.

Every packable type becomes groups of 32 values with one float scale (and min) per group,
with the same dequantized values as the GGUF reference (tests/quantization/test_gguf_repack.py):
- Q8_0 -> int8 values, the block's fp16 d as scale;
- Q5_0 -> int8 values q - 16 (-16..15), scale d: the integer dot products of the int8
  kernels take them as they are, and the tiled q8 copy keeps them in five bits (qgemm.py);
- Q4_0 / Q4_1 -> int4: the nibbles are already in our layout, so the bytes are copied and
  the fp16 fields become scale d and min (Q4_0: -8 d; Q4_1: m);
- Q4_K -> int4 groups of 32 (its sub-blocks): nibbles re-laid out from Q4_K's 64-value
  chunks, scale d * sc and min -(dmin * m), the products rounded once to float32 as ggml's
  own dequantizer rounds them;
- Q6_K -> int8 values q - 32 (-32..31) in groups of 16 (its sub-blocks), scale d * sc: the
  int8 kernels take 16-value groups (two scales per 32-value step);
- Q5_1 / Q5_K -> int8 values q (0..31) with scale and min, the int4 affine form on int8
  values: Q5_1 d and m; Q5_K d * sc and -(dmin * m) per sub-block of 32.
Rows keep the same fix-up (llama q/k RoPE order) as the float path, and a stacked expert
tensor is repacked one expert (one HF weight name) at a time.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from tokenmill.layers.lazy import Owned
from tokenmill.models.loader import gguf_kquants, gguf_llama
from tokenmill.models.loader.gguf_quants import ggml_type

# GGML type name -> the packed kind it becomes, and its group size
PACKED_KIND = {"Q8_0": "i8", "Q5_0": "i8", "Q5_1": "i8", "Q4_0": "i4", "Q4_1": "i4",
               "Q4_K": "i4", "Q5_K": "i8", "Q6_K": "i8"}
GROUP_SIZE = {name: 16 if name == "Q6_K" else 32 for name in PACKED_KIND}
HAS_MINS = {name: name in ("Q4_0", "Q4_1", "Q4_K", "Q5_1", "Q5_K") for name in PACKED_KIND}
_TYPE_ID = {"Q8_0": 8, "Q5_0": 6, "Q5_1": 7, "Q4_0": 2, "Q4_1": 3, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


def tensor_types(checkpoint) -> dict[str, str]:
    """HF weight name -> GGML type name, for every tensor HF has a parameter for."""
    arch = gguf_llama.architecture(checkpoint.gguf)
    num_experts = gguf_llama.num_experts(checkpoint.hf_config)
    types = {}
    for gguf_name, info in checkpoint.gguf.tensors.items():
        for name, _ in gguf_llama.hf_names(gguf_name, arch, num_experts):
            types[name] = info.type_name
    return types


def _f16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 field at byte ``start`` of every block [..., type_size] -> float32 [...]."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0].astype(np.float32)


def _pack_nibbles(values: np.ndarray) -> np.ndarray:
    """uint8 [n, K] values 0..15 -> [n, K/2] in our int4 layout (formats.pack_int4): in each
    run of 32, byte j holds value j (low nibble) and value j + 16 (high nibble)."""
    n, k = values.shape
    runs = values.reshape(n, k // 32, 2, 16)
    return (runs[:, :, 0] | (runs[:, :, 1] << np.uint8(4))).reshape(n, k // 2)


def repack(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """Raw bytes of one [N, K] tensor -> {"qweight", "scales"[, "mins"]} (numpy, rows first;
    scales / mins float32 [N, K / GROUP_SIZE])."""
    n, k = shape
    t = ggml_type(_TYPE_ID[type_name])
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // t.block_size, t.type_size)
    flat = blocks.reshape(-1, t.type_size)
    if type_name == "Q6_K":
        return {"qweight": gguf_kquants.q6_k_values(flat).reshape(n, k),
                "scales": gguf_kquants.q6_k_scales(flat).reshape(n, k // 16)}
    if type_name in ("Q4_K", "Q5_K"):
        scale, low = gguf_kquants.k_sub_block_params(flat)
        affine = {"scales": scale.reshape(n, k // 32), "mins": -low.reshape(n, k // 32)}
        if type_name == "Q5_K":
            return {"qweight": gguf_kquants.q5_k_values(flat).reshape(n, k).view(np.int8), **affine}
        return {"qweight": _pack_nibbles(gguf_kquants.q4_k_values(flat).reshape(n, k)), **affine}
    d = _f16_field(blocks, 0)
    if type_name == "Q8_0":
        return {"qweight": np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(n, k), "scales": d}
    if type_name == "Q5_0":
        q = gguf_kquants.q5_values(flat, 2).astype(np.int8) - np.int8(16)
        return {"qweight": q.reshape(n, k), "scales": d}
    if type_name == "Q5_1":
        q = gguf_kquants.q5_values(flat, 4).view(np.int8)
        return {"qweight": q.reshape(n, k), "scales": d, "mins": _f16_field(blocks, 2)}
    if type_name == "Q4_0":
        return {"qweight": blocks[:, :, 2:].reshape(n, k // 2), "scales": d, "mins": -8.0 * d}
    return {"qweight": blocks[:, :, 4:].reshape(n, k // 2), "scales": d, "mins": _f16_field(blocks, 2)}


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
            packed = _repack_by_rows(gguf, raw, info.type_name, shape, release=not lazy)
            if heads:  # the q/k row un-permutation of the float path, on packed rows
                packed = {key: gguf_llama.unpermute_rope_rows(value, heads) for key, value in packed.items()}
            for prefix in targets:
                for key, value in packed.items():   # fresh arrays (_repack_by_rows): handed over
                    yield f"{prefix}.{key}", Owned(torch.from_numpy(np.ascontiguousarray(value)))
        if not lazy:   # the float conversions' pages too (lazy tensors are read later)
            gguf.release_tensor(gguf_name)


REPACK_BYTES = 16 << 20   # stored bytes repacked at a time (a few MB of temporaries)


def _repack_by_rows(gguf, raw: np.ndarray, type_name: str, shape: tuple[int, int],
                    release: bool) -> dict[str, np.ndarray]:
    """``repack`` a slice of rows at a time into the outputs, giving each slice's mapped
    pages back (``release``) once copied: a large weight (Gemma3's 262k-row tied head:
    178 MB of Q8_0) then never sits in memory twice over next to its temporaries."""
    n, k = shape
    row_bytes = raw.nbytes // n
    step = max(1, REPACK_BYTES // row_bytes)
    out: dict[str, np.ndarray] = {}
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        rows = raw[r0 * row_bytes:r1 * row_bytes]
        for key, value in repack(rows, type_name, (r1 - r0, k)).items():
            if key not in out:
                out[key] = np.empty((n,) + value.shape[1:], dtype=value.dtype)
            out[key][r0:r1] = value
        if release:   # (a later read faults the pages back in from the file)
            gguf.release_bytes(rows)
    return out


def _float_tensors(gguf, cfg: dict, gguf_name: str) -> Iterator[tuple[str, torch.Tensor]]:
    for name, values in gguf_llama.hf_tensors(gguf, cfg, gguf_name):
        yield name, torch.from_numpy(values)
