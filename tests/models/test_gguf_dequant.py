"""Our numpy dequantization == the `gguf` package's reference, bit for bit."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402

from tokenmill.models.loader import CheckpointError  # noqa: E402
from tokenmill.models.loader.gguf_quants import GGML_TYPES, dequantize  # noqa: E402

SHAPES = [(1, 32), (3, 64), (7, 256), (2, 5, 96)]
SCALE_BYTES = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2]}  # byte offsets of fp16 fields per block


def _random_blocks(qtype, shape, rng) -> np.ndarray:
    """Random quantized bytes whose fp16 scale fields are finite (random bits elsewhere)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    num_blocks = int(np.prod(shape)) // block_size
    raw = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    for off in SCALE_BYTES[qtype]:
        scales = rng.standard_normal(num_blocks).astype(np.float16)
        raw[:, off:off + 2] = scales.view(np.uint8).reshape(num_blocks, 2)
    return raw.reshape(*shape[:-1], shape[-1] // block_size * type_size)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
@pytest.mark.parametrize("shape", SHAPES)
def test_block_quants_match_reference(qtype, shape):
    rng = np.random.default_rng(hash((int(qtype), shape)) % 2**32)
    raw = _random_blocks(qtype, shape, rng)
    expected = gguf.quants.dequantize(raw, qtype)
    ours = dequantize(raw.reshape(-1), int(qtype), shape)
    assert ours.dtype == np.float32 and ours.shape == shape
    np.testing.assert_array_equal(ours, expected)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_roundtrip_through_reference_quantizer(qtype):
    rng = np.random.default_rng(int(qtype))
    values = rng.standard_normal((4, 128)).astype(np.float32)
    raw = gguf.quants.quantize(values, qtype)
    np.testing.assert_array_equal(dequantize(raw.reshape(-1), int(qtype), values.shape),
                                  gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype,dtype", [(Q.F32, np.float32), (Q.F16, np.float16)])
@pytest.mark.parametrize("shape", SHAPES)
def test_float_types(qtype, dtype, shape):
    values = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    ours = dequantize(values.view(np.uint8).reshape(-1), int(qtype), shape)
    np.testing.assert_array_equal(ours, values.astype(np.float32))


@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_matches_reference(shape):
    bits = np.random.default_rng(1).integers(0, 2**16, size=shape, dtype=np.uint16)
    bits[(bits & 0x7F80) == 0x7F80] = 0x3F80  # keep finite (no inf/nan patterns)
    raw = bits.view(np.uint8).reshape(*shape[:-1], shape[-1] * 2)
    expected = gguf.quants.dequantize(raw, Q.BF16)
    np.testing.assert_array_equal(dequantize(raw.reshape(-1), int(Q.BF16), shape), expected)


def test_type_table_matches_gguf_constants():
    for type_id, t in GGML_TYPES.items():
        assert GGML_QUANT_SIZES[Q(type_id)] == (t.block_size, t.type_size), t.name
        assert Q(type_id).name == t.name


def test_size_mismatch_and_unsupported_type_raise():
    with pytest.raises(CheckpointError):
        dequantize(np.zeros(33, np.uint8), int(Q.Q8_0), (32,))
    with pytest.raises(CheckpointError, match="Q4_K"):   # 144 bytes is one block, not two
        dequantize(np.zeros(144, np.uint8), int(Q.Q4_K), (512,))
    with pytest.raises(CheckpointError, match="unsupported ggml tensor type"):
        dequantize(np.zeros(4, np.uint8), 999, (1,))
