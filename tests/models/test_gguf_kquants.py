"""5-bit and K-quant dequantization == the `gguf` package's reference, bit for bit, on
random blocks (random bits everywhere except finite fp16 scale fields) of several shapes."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402

from tokenmill.models.loader.gguf_quants import GGML_TYPES, SUPPORTED_DEQUANT, dequantize  # noqa: E402

# byte offsets of the fp16 scale fields in each block
FP16_FIELDS = {Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q2_K: [80, 82], Q.Q3_K: [108],
               Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}
SHAPES_32 = [(1, 32), (3, 64), (5, 2, 96)]
SHAPES_256 = [(1, 256), (3, 512), (2, 3, 256)]


def _random_blocks(qtype, shape, rng) -> np.ndarray:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    num_blocks = int(np.prod(shape)) // block_size
    raw = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    for off in FP16_FIELDS.get(qtype, []):
        raw[:, off:off + 2] = rng.standard_normal(num_blocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(*shape[:-1], shape[-1] // block_size * type_size)


CASES = [(q, s) for q in FP16_FIELDS for s in (SHAPES_32 if GGML_QUANT_SIZES[q][0] == 32 else SHAPES_256)]


@pytest.mark.parametrize("qtype,shape", CASES, ids=[f"{q.name}-{s}" for q, s in CASES])
def test_matches_gguf_reference_exactly(qtype, shape):
    rng = np.random.default_rng([int(qtype), *shape])
    raw = _random_blocks(qtype, shape, rng)
    ours = dequantize(raw.reshape(-1), int(qtype), shape)
    assert ours.dtype == np.float32 and ours.shape == shape
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1])
def test_roundtrip_through_reference_quantizer(qtype):
    values = np.random.default_rng(int(qtype)).standard_normal((4, 128)).astype(np.float32)
    raw = gguf.quants.quantize(values, qtype)
    ours = dequantize(raw.reshape(-1), int(qtype), values.shape)
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(raw, qtype))
    assert np.abs(ours - values).max() < 0.2   # and it is a real approximation


@pytest.mark.parametrize("qtype,scale_bytes", [(Q.Q8_K, 4), (Q.Q8_1, 8)])
def test_q8_k_and_q8_1_follow_the_c_struct(qtype, scale_bytes):
    # gguf has no reference for these (activation-only types); check against the struct:
    # f32 d (Q8_1: then f32 sum), int8 values, (Q8_K: then 16 int16 block sums).
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    d = rng.standard_normal(3).astype(np.float32)
    qs = rng.integers(-128, 128, size=(3, block_size), dtype=np.int8)
    tail = rng.integers(0, 256, size=(3, type_size - scale_bytes - block_size), dtype=np.uint8)
    raw = np.concatenate([d.view(np.uint8).reshape(3, 4), np.zeros((3, scale_bytes - 4), np.uint8),
                          qs.view(np.uint8), tail], axis=1)
    ours = dequantize(raw.reshape(-1), int(qtype), (3, block_size))
    np.testing.assert_array_equal(ours, qs.astype(np.float32) * d[:, None])


@pytest.mark.parametrize("qtype,dtype", [(Q.I8, "<i1"), (Q.I16, "<i2"), (Q.I32, "<i4"), (Q.F64, "<f8")])
def test_plain_types(qtype, dtype):
    values = (np.random.default_rng(2).standard_normal((3, 8)) * 100).astype(dtype)
    np.testing.assert_array_equal(dequantize(values.view(np.uint8).reshape(-1), int(qtype), (3, 8)),
                                  values.astype(np.float32))


def test_every_listed_type_dequantizes():
    assert SUPPORTED_DEQUANT == frozenset(GGML_TYPES)
