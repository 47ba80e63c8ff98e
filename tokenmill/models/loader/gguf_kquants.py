"""Vectorised numpy dequantization of the 5-bit and K-quant GGML types.

Each function takes ``blocks`` [num_blocks, type_size] uint8 and returns float32
[num_blocks, block_size]. Layouts follow ggml's C block structs (ggml-common.h). The float
operations are done in the same order as ggml's reference dequantizers, so results are
bit-identical to them (and to the ``gguf`` package), not merely close.

K-quants group 256 values into a super-block with fp16 super-scales ``d`` / ``dmin`` and
small per-sub-block integer scales; a value is ``d * scale * q - dmin * min``.
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 field at ``start`` of each block as float32 [num_blocks, 1]."""
    return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16).astype(np.float32)


def _unpack(packed: np.ndarray, shifts, mask: int) -> np.ndarray:
    """[n, groups, width] bytes -> [n, groups, len(shifts), width]: field ``s`` of each byte.

    ggml stores low bit-planes first: field k of a byte belongs to the k-th run of ``width``
    consecutive values, so reshaping the result to [n, -1] gives values in order."""
    shifts = np.asarray(shifts, dtype=np.uint8).reshape(1, 1, -1, 1)
    return (packed[:, :, None, :] >> shifts) & np.uint8(mask)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: a little-endian u32 whose bit j is the 5th bit of value j -> [n, 32]."""
    words = np.ascontiguousarray(qh).view("<u4")                    # [n, 1]
    return ((words >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def q5_values(blocks: np.ndarray, qh_at: int) -> np.ndarray:
    """The 5-bit values 0..31 of a Q5_0/Q5_1 block: low nibbles (j, then j + 16) + high bit."""
    n = blocks.shape[0]
    low = _unpack(blocks[:, qh_at + 4:].reshape(n, 1, 16), (0, 4), 0x0F).reshape(n, 32)
    return low | (_high_bits_32(blocks[:, qh_at:qh_at + 4]) << np.uint8(4))


def dequant_q5_0(blocks: np.ndarray) -> np.ndarray:
    # block_q5_0: fp16 d, u32 qh, 16 bytes of nibbles; value = d * (q - 16)
    q = q5_values(blocks, 2).astype(np.int8) - np.int8(16)
    return _f16(blocks, 0) * q.astype(np.float32)


def dequant_q5_1(blocks: np.ndarray) -> np.ndarray:
    # block_q5_1: fp16 d, fp16 m, u32 qh, 16 bytes of nibbles; value = d * q + m
    return _f16(blocks, 0) * q5_values(blocks, 4).astype(np.float32) + _f16(blocks, 2)


def dequant_q8_1(blocks: np.ndarray) -> np.ndarray:
    # block_q8_1 as the gguf table sizes it: f32 d, f32 s (sum, unused here), 32 int8
    d = np.ascontiguousarray(blocks[:, 0:4]).view("<f4")
    return np.ascontiguousarray(blocks[:, 8:]).view(np.int8).astype(np.float32) * d


def dequant_q8_k(blocks: np.ndarray) -> np.ndarray:
    # block_q8_K: f32 d, 256 int8, 16 int16 block sums (only used by dot products)
    d = np.ascontiguousarray(blocks[:, 0:4]).view("<f4")
    return np.ascontiguousarray(blocks[:, 4:4 + QK_K]).view(np.int8).astype(np.float32) * d


def dequant_q2_k(blocks: np.ndarray) -> np.ndarray:
    # block_q2_K: 16 scale bytes (low nibble scale, high nibble min), 64 bytes of 2-bit
    # values (two halves of 32 bytes, four bit-planes each), fp16 d, fp16 dmin
    n = blocks.shape[0]
    scales = blocks[:, :16]
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    dl = (d * (scales & 0x0F).astype(np.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).astype(np.float32)).reshape(n, 16, 1)
    q = _unpack(blocks[:, 16:80].reshape(n, 2, 32), (0, 2, 4, 6), 0x03).reshape(n, 16, 16)
    return (dl * q.astype(np.float32) - ml).reshape(n, QK_K)


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """12 bytes -> 16 signed 6-bit scales: low 4 bits from bytes 0-7 (nibbles), high 2 bits
    from bytes 8-11 (bit pairs), then minus 32."""
    n = packed.shape[0]
    low = _unpack(packed[:, :8].reshape(n, 1, 8), (0, 4), 0x0F).reshape(n, 16)
    high = _unpack(packed[:, 8:12].reshape(n, 1, 4), (0, 2, 4, 6), 0x03).reshape(n, 16)
    return ((low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)).astype(np.float32)


def dequant_q3_k(blocks: np.ndarray) -> np.ndarray:
    # block_q3_K: 32 bytes hmask, 64 bytes of 2-bit values, 12 bytes scales, fp16 d.
    # A *clear* hmask bit subtracts 4 (values are -4..3).
    n = blocks.shape[0]
    dl = (_f16(blocks, 108) * _q3_k_scales(blocks[:, 96:108])).reshape(n, 16, 1)
    low = _unpack(blocks[:, 32:96].reshape(n, 2, 32), (0, 2, 4, 6), 0x03).reshape(n, 16, 16)
    high = _unpack(blocks[:, :32].reshape(n, 1, 32), range(8), 0x01).reshape(n, 16, 16) ^ np.uint8(1)
    q = (low.astype(np.int8) - (high << np.uint8(2)).astype(np.int8)).astype(np.float32)
    return (dl * q).reshape(n, QK_K)


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (get_scale_min_k4)."""
    n = packed.shape[0]
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scale = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    low = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return scale.reshape(n, 8).astype(np.float32), low.reshape(n, 8).astype(np.float32)


def k_sub_block_params(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: (d * scale, dmin * min) of the 8 sub-blocks of 32, float32 [n, 8]: a
    value is ``q * first - second`` (the products rounded once, as ggml does)."""
    scale, low = _k_scale_min(blocks[:, 4:16])
    return _f16(blocks, 0) * scale, _f16(blocks, 2) * low


def q4_k_values(blocks: np.ndarray) -> np.ndarray:
    """Q4_K: 128 bytes in 4 groups of 32 (low nibbles = values 64c + j, high = 64c + 32 + j)
    -> the 256 values 0..15 in order, uint8 [n, 256]."""
    n = blocks.shape[0]
    return _unpack(blocks[:, 16:].reshape(n, 4, 32), (0, 4), 0x0F).reshape(n, QK_K)


def q5_k_values(blocks: np.ndarray) -> np.ndarray:
    """Q5_K: Q4_K's nibbles plus 32 bytes qh (bit k of byte j = 5th bit of value 32k + j)
    -> the 256 values 0..31 in order, uint8 [n, 256]."""
    n = blocks.shape[0]
    low = _unpack(blocks[:, 48:].reshape(n, 4, 32), (0, 4), 0x0F).reshape(n, 8, 32)
    high = _unpack(blocks[:, 16:48].reshape(n, 1, 32), range(8), 0x01).reshape(n, 8, 32)
    return (low | (high << np.uint8(4))).reshape(n, QK_K)


def _k_affine(blocks: np.ndarray, q: np.ndarray) -> np.ndarray:
    """d * scale * q - dmin * min over 8 sub-blocks of 32, the shared Q4_K/Q5_K tail."""
    n = blocks.shape[0]
    d, dm = k_sub_block_params(blocks)
    return (d.reshape(n, 8, 1) * q.reshape(n, 8, 32).astype(np.float32) - dm.reshape(n, 8, 1)).reshape(n, QK_K)


def dequant_q4_k(blocks: np.ndarray) -> np.ndarray:
    # block_q4_K: fp16 d, fp16 dmin, 12 bytes scales/mins, 128 bytes of nibbles
    return _k_affine(blocks, q4_k_values(blocks))


def dequant_q5_k(blocks: np.ndarray) -> np.ndarray:
    # block_q5_K: as Q4_K plus 32 bytes of fifth bits
    return _k_affine(blocks, q5_k_values(blocks))


def q6_k_values(blocks: np.ndarray) -> np.ndarray:
    """Q6_K: 128 bytes of low nibbles and 64 bytes of high bit pairs -> the 256 values
    q - 32 (-32..31) in order, int8 [n, 256]."""
    n = blocks.shape[0]
    low = _unpack(blocks[:, :128].reshape(n, 2, 64), (0, 4), 0x0F).reshape(n, 8, 32)
    high = _unpack(blocks[:, 128:192].reshape(n, 2, 32), (0, 2, 4, 6), 0x03).reshape(n, 8, 32)
    return ((low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(n, QK_K)


def q6_k_scales(blocks: np.ndarray) -> np.ndarray:
    """Q6_K: d * scale of the 16 sub-blocks of 16 values, float32 [n, 16]."""
    return _f16(blocks, 208) * np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)


def dequant_q6_k(blocks: np.ndarray) -> np.ndarray:
    # block_q6_K: 128 bytes low nibbles, 64 bytes high bit pairs, 16 int8 scales, fp16 d;
    # value = d * scale * (q - 32) over 16 sub-blocks of 16
    n = blocks.shape[0]
    q = q6_k_values(blocks).astype(np.float32).reshape(n, 16, 16)
    return (q6_k_scales(blocks).reshape(n, 16, 1) * q).reshape(n, QK_K)


# ggml type id -> dequantizer of [num_blocks, type_size] blocks
KQUANT_DEQUANT = {
    6: dequant_q5_0, 7: dequant_q5_1, 9: dequant_q8_1, 10: dequant_q2_k, 11: dequant_q3_k,
    12: dequant_q4_k, 13: dequant_q5_k, 14: dequant_q6_k, 15: dequant_q8_k,
}


def _int(dtype: str):
    def convert(raw: np.ndarray) -> np.ndarray:
        return raw.view(dtype).astype(np.float32)
    return convert


# Plain element types that may hold weights (rare, but legal in GGUF)
EXTRA_FLAT = {24: _int("<i1"), 25: _int("<i2"), 26: _int("<i4"), 27: _int("<i8"), 28: _int("<f8")}
