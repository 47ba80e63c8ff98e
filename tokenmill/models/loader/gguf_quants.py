"""GGML tensor types: block geometry for every common type, numpy dequantization for some.

Each quantized type stores a row as blocks of ``block_size`` values in ``type_size`` bytes.
The geometry is known for more types than we can dequantize, so the reader can validate
tensor sizes in any usual file and fail with a clear message only when a tensor's values
are actually needed. Dequantization is vectorised over blocks (no Python loop per block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .errors import CheckpointError
from .gguf_kquants import EXTRA_FLAT, KQUANT_DEQUANT


@dataclass(frozen=True)
class GGMLType:
    name: str
    block_size: int  # values per block
    type_size: int  # bytes per block


# id -> geometry, per ggml.h / the GGUF spec. Sizes follow the C block structs, e.g.
# Q4_1 = fp16 d + fp16 m + 16 bytes of nibbles = 20 bytes for 32 values.
GGML_TYPES: dict[int, GGMLType] = {
    0: GGMLType("F32", 1, 4),
    1: GGMLType("F16", 1, 2),
    2: GGMLType("Q4_0", 32, 2 + 16),
    3: GGMLType("Q4_1", 32, 2 + 2 + 16),
    6: GGMLType("Q5_0", 32, 2 + 4 + 16),
    7: GGMLType("Q5_1", 32, 2 + 2 + 4 + 16),
    8: GGMLType("Q8_0", 32, 2 + 32),
    9: GGMLType("Q8_1", 32, 4 + 4 + 32),
    10: GGMLType("Q2_K", 256, 16 + 64 + 2 + 2),
    11: GGMLType("Q3_K", 256, 32 + 64 + 12 + 2),
    12: GGMLType("Q4_K", 256, 2 + 2 + 12 + 128),
    13: GGMLType("Q5_K", 256, 2 + 2 + 12 + 32 + 128),
    14: GGMLType("Q6_K", 256, 128 + 64 + 16 + 2),
    15: GGMLType("Q8_K", 256, 4 + 256 + 32),
    24: GGMLType("I8", 1, 1),
    25: GGMLType("I16", 1, 2),
    26: GGMLType("I32", 1, 4),
    27: GGMLType("I64", 1, 8),
    28: GGMLType("F64", 1, 8),
    30: GGMLType("BF16", 1, 2),
}


def ggml_type(type_id: int) -> GGMLType:
    try:
        return GGML_TYPES[type_id]
    except KeyError:
        raise CheckpointError(f"unsupported ggml tensor type id {type_id}") from None


def tensor_nbytes(type_id: int, num_values: int) -> int:
    """Bytes a tensor of ``num_values`` values takes; the caller checks divisibility."""
    t = ggml_type(type_id)
    return num_values // t.block_size * t.type_size


def _f16(blocks: np.ndarray, start: int, stop: int) -> np.ndarray:
    """An fp16 field of each block as a float32 column [num_blocks, 1]."""
    return np.ascontiguousarray(blocks[:, start:stop]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[num_blocks, 16] bytes -> [num_blocks, 32] values: low nibbles first, then high ones
    (ggml packs element j in the low half and element j + 16 in the high half of byte j)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)


def _dequant_q8_0(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks, 0, 2)
    qs = np.ascontiguousarray(blocks[:, 2:]).view(np.int8).astype(np.float32)
    return d * qs


def _dequant_q4_0(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks, 0, 2)
    return d * (_nibbles(blocks[:, 2:]) - np.float32(8))


def _dequant_q4_1(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks, 0, 2)
    m = _f16(blocks, 2, 4)
    return d * _nibbles(blocks[:, 4:]) + m


def _plain(dtype: np.dtype) -> Callable[[np.ndarray], np.ndarray]:
    def convert(raw: np.ndarray) -> np.ndarray:
        return raw.view(dtype).astype(np.float32)

    return convert


def _dequant_bf16(raw: np.ndarray) -> np.ndarray:
    # bf16 is the top half of an fp32: widen to 32 bits and shift into place.
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


_FLAT = {0: _plain(np.dtype("<f4")), 1: _plain(np.dtype("<f2")), 30: _dequant_bf16}
_BLOCKED = {8: _dequant_q8_0, 2: _dequant_q4_0, 3: _dequant_q4_1}
# 5-bit and K-quant types live in their own module (same block-array interface).
_BLOCKED.update(KQUANT_DEQUANT)
_FLAT.update(EXTRA_FLAT)

SUPPORTED_DEQUANT = frozenset(_FLAT) | frozenset(_BLOCKED)


def dequantize(raw: np.ndarray, type_id: int, shape: tuple[int, ...]) -> np.ndarray:
    """Dequantize raw tensor bytes to a new float32 array.

    ``raw``: uint8 bytes of the whole tensor; ``shape``: numpy order (last dim = GGUF ne0).
    """
    t = ggml_type(type_id)
    num_values = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if num_values % t.block_size or raw.size != num_values // t.block_size * t.type_size:
        raise CheckpointError(f"{t.name} data of {raw.size} bytes does not hold shape {shape}")
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if type_id in _FLAT:
        out = _FLAT[type_id](raw)
    elif type_id in _BLOCKED:
        out = _BLOCKED[type_id](raw.reshape(-1, t.type_size))
    else:
        raise CheckpointError(f"dequantization of ggml type {t.name} is not supported yet")
    return np.asarray(out, dtype=np.float32).reshape(shape)
