"""GGUF blocks repacked for the quantized matmul (layers/quant/gguf.py) hold exactly the
values of the GGUF reference dequantizer, and the kernels compute with them as with any
packed weight: random blocks of every packable type, several shapes."""
import numpy as np
import pytest
import torch

from tokenmill.layers import native
from tokenmill.layers.quant import gguf, qgemm
from tokenmill.layers.quant.formats import Packed, dequantize_stored
from tokenmill.layers.quant.matmul import packed_linear, reference_linear
from tokenmill.models.loader.gguf_quants import dequantize, ggml_type

TYPE_IDS = {"Q8_0": 8, "Q5_0": 6, "Q5_1": 7, "Q4_0": 2, "Q4_1": 3, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
FP16_FIELDS = {"Q8_0": [0], "Q5_0": [0], "Q5_1": [0, 2], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2],
               "Q5_K": [0, 2], "Q6_K": [208]}
SHAPES = [(3, 256), (8, 512), (17, 768)]   # [N, K]: K a multiple of Q4_K's 256


def _random_tensor(type_name: str, shape, seed: int) -> np.ndarray:
    """Random bytes (finite, small fp16 scale fields) of a [N, K] tensor of that type."""
    t = ggml_type(TYPE_IDS[type_name])
    rng = np.random.default_rng(seed)
    num_blocks = shape[0] * shape[1] // t.block_size
    raw = rng.integers(0, 256, size=(num_blocks, t.type_size), dtype=np.uint8)
    for off in FP16_FIELDS[type_name]:
        field = (rng.standard_normal(num_blocks) * 0.05).astype(np.float16)
        raw[:, off:off + 2] = field.view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1)


def _packed(type_name: str, raw: np.ndarray, shape) -> Packed:
    parts = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in gguf.repack(raw, type_name, shape).items()}
    return Packed(gguf.PACKED_KIND[type_name], parts["qweight"], parts["scales"], parts.get("mins"),
                  gguf.GROUP_SIZE[type_name], shape[0], shape[1])


@pytest.mark.parametrize("type_name", sorted(TYPE_IDS))
@pytest.mark.parametrize("shape", SHAPES)
def test_repacked_values_equal_the_reference_dequantizer(type_name, shape):
    raw = _random_tensor(type_name, shape, seed=hash((type_name, shape)) % 2**32)
    reference = dequantize(raw, TYPE_IDS[type_name], shape)
    p = _packed(type_name, raw, shape)
    np.testing.assert_array_equal(dequantize_stored(p).numpy(), reference)


@pytest.mark.parametrize("type_name", sorted(TYPE_IDS))
def test_repacking_by_row_slices_from_a_released_map_gives_the_same_arrays(type_name, tmp_path, monkeypatch):
    """Slices of a few rows at a time (the last one short), each slice's mapped pages given
    back after it is copied: the same arrays as one whole repack, and the map still reads
    the file's bytes afterwards."""
    from tokenmill.models.loader.gguf_reader import GGUFFile
    shape = (201, 1024)   # slices of tens of KB: whole pages inside each are given back
    raw = _random_tensor(type_name, shape, seed=len(type_name))
    path = tmp_path / "t.bin"
    pad = 4096 * 3 + 100   # the tensor starts mid-page, as in a GGUF
    path.write_bytes(b"\0" * pad + raw.tobytes())
    mapped = GGUFFile.__new__(GGUFFile)
    mapped._buf = np.memmap(path, dtype=np.uint8, mode="r")
    view = mapped._buf[pad:pad + raw.nbytes]
    monkeypatch.setattr(gguf, "REPACK_BYTES", raw.nbytes // 5)
    got = gguf._repack_by_rows(mapped, view, type_name, shape, release=True)
    want = gguf.repack(raw, type_name, shape)
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])
    np.testing.assert_array_equal(np.asarray(view), raw)


def test_packed_kinds_cover_the_table():
    assert set(gguf.PACKED_KIND) == set(TYPE_IDS)
    assert gguf.PACKED_KIND["Q5_0"] == "i8" and gguf.PACKED_KIND["Q4_K"] == "i4"
    assert gguf.PACKED_KIND["Q6_K"] == "i8" and gguf.GROUP_SIZE["Q6_K"] == 16
    assert gguf.HAS_MINS["Q5_K"] and gguf.HAS_MINS["Q5_1"] and not gguf.HAS_MINS["Q5_0"]


@pytest.mark.skipif(not native.buildable(), reason="no C compiler, or a CPU without AVX2")
@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("activations", ["fp32", "q8"])
@pytest.mark.parametrize("rows", [1, 3, 5, 40])
def test_kernels_on_repacked_k_quants_match_the_reference(type_name, activations, rows):
    shape = (40, 512)   # 40 rows: two whole tiles of 16 and a short one
    p = _packed(type_name, _random_tensor(type_name, shape, seed=rows), shape)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    if activations == "q8" and qgemm.applies(p):
        p.tiled = qgemm.tile(p)   # as loading does: q8 steps of any size take the tiled GEMM
    got = packed_linear(x, p, activations=activations)
    want = reference_linear(x, p, activations=activations)
    # summation order differs; Q6_K's scales (d * sc, sc up to 127) make large outputs
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
