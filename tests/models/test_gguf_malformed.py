"""Malformed GGUF files fail fast with CheckpointError: no crash, hang or huge allocation."""

import struct

import numpy as np
import pytest

from tokenmill.models.loader import CheckpointError, load_tokenizer, open_checkpoint
from tokenmill.models.loader.gguf_reader import GGUFFile


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, type_id: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", type_id) + payload


def _tensor(name: str, dims, type_id: int, offset: int) -> bytes:
    return _str(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", type_id, offset)


def gguf_bytes(kvs=None, tensors=None, data=b"", version=3, num_tensors=None, num_kv=None, align=32) -> bytes:
    """Hand-encoded GGUF so every field can be made wrong. Default: one f32 tensor 'w' [8]."""
    kvs = [_kv("general.architecture", 8, _str("llama"))] if kvs is None else kvs
    tensors = [_tensor("w", [8], 0, 0)] if tensors is None else tensors
    data = data or np.arange(8, dtype=np.float32).tobytes()
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors) if num_tensors is None else num_tensors,
                                 len(kvs) if num_kv is None else num_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    body += b"\0" * (-len(body) % align)
    return body + data


def _write(tmp_path, blob: bytes) -> str:
    path = tmp_path / "bad.gguf"
    path.write_bytes(blob)
    return str(path)


def test_hand_encoded_baseline_is_valid(tmp_path):
    f = GGUFFile(_write(tmp_path, gguf_bytes()))
    np.testing.assert_array_equal(f.dequantize("w"), np.arange(8, dtype=np.float32))


CASES = {
    "bad magic": (lambda: b"GGUX" + gguf_bytes()[4:], "magic"),
    "version 1": (lambda: gguf_bytes(version=1), "version"),
    "big-endian version": (lambda: gguf_bytes(version=3 << 24), "version"),
    "empty": (lambda: b"", "too small"),
    "absurd tensor count": (lambda: gguf_bytes(num_tensors=2**62), "tensor count"),
    "absurd kv count": (lambda: gguf_bytes(num_kv=2**63), "metadata count"),
    "kv count too high": (lambda: gguf_bytes(num_kv=5), None),  # tensor infos then misread as KVs
    "huge string length": (lambda: gguf_bytes(kvs=[_kv("k", 8, struct.pack("<Q", 2**62) + b"x" * 40)]), "truncated"),
    "huge key length": (lambda: gguf_bytes(kvs=[struct.pack("<Q", 2**63) + b"x" * 40]), "truncated"),
    "bad value type": (lambda: gguf_bytes(kvs=[_kv("k", 99, b"\0" * 8)]), "bad value type"),
    "huge array": (lambda: gguf_bytes(kvs=[_kv("k", 9, struct.pack("<IQ", 4, 2**61))]), "truncated"),
    "huge string array": (lambda: gguf_bytes(kvs=[_kv("k", 9, struct.pack("<IQ", 8, 2**40))]), "truncated"),
    "bad array type": (lambda: gguf_bytes(kvs=[_kv("k", 9, struct.pack("<IQ", 77, 1))]), "bad value type"),
    "deep nested arrays": (lambda: gguf_bytes(kvs=[_kv("k", 9, struct.pack("<IQ", 9, 1) * 8 + b"\0" * 64)]), "bad value type"),
    "invalid utf-8 key": (lambda: gguf_bytes(kvs=[struct.pack("<Q", 2) + b"\xff\xfe" + struct.pack("<I", 4) + b"\0" * 4]), "UTF-8"),
    "duplicate key": (lambda: gguf_bytes(kvs=[_kv("k", 4, b"\0" * 4)] * 2), "duplicate metadata"),
    "bad alignment": (lambda: gguf_bytes(kvs=[_kv("general.alignment", 4, struct.pack("<I", 3))]), "alignment"),
    "zero alignment": (lambda: gguf_bytes(kvs=[_kv("general.alignment", 4, struct.pack("<I", 0))]), "alignment"),
    "duplicate tensor": (lambda: gguf_bytes(tensors=[_tensor("w", [8], 0, 0)] * 2), "duplicate tensor"),
    "too many dims": (lambda: gguf_bytes(tensors=[_tensor("w", [1] * 5, 0, 0)]), "dims"),
    "zero dims": (lambda: gguf_bytes(tensors=[_tensor("w", [], 0, 0)]), "dims"),
    "zero-size dim": (lambda: gguf_bytes(tensors=[_tensor("w", [8, 0], 0, 0)]), "bad dims"),
    "huge dims": (lambda: gguf_bytes(tensors=[_tensor("w", [2**63, 2**63, 2**63, 2**63], 0, 0)]), "larger than the file"),
    "unknown tensor type": (lambda: gguf_bytes(tensors=[_tensor("w", [8], 123, 0)]), "unknown ggml type"),
    "row not whole blocks": (lambda: gguf_bytes(tensors=[_tensor("w", [16], 8, 0)]), "block size"),
    "offset past end": (lambda: gguf_bytes(tensors=[_tensor("w", [8], 0, 2**40)]), "past the end"),
    "unaligned offset": (lambda: gguf_bytes(tensors=[_tensor("w", [4], 0, 4)]), "aligned"),
    "overlapping tensors": (lambda: gguf_bytes(tensors=[_tensor("a", [8], 0, 0), _tensor("b", [8], 0, 0)]), "overlap"),
    "data truncated": (lambda: gguf_bytes(tensors=[_tensor("w", [64], 0, 0)]), "past the end"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_file_raises_checkpoint_error(tmp_path, case):
    make, message = CASES[case]
    with pytest.raises(CheckpointError, match=message):
        GGUFFile(_write(tmp_path, make()))


def test_every_truncation_raises_checkpoint_error(tmp_path):
    blob = gguf_bytes(kvs=[_kv("general.architecture", 8, _str("llama")), _kv("a", 9, struct.pack("<IQ", 8, 2) + _str("x") + _str("yz"))])
    for cut in range(0, len(blob) - 32):  # the last 32 bytes are tensor data
        with pytest.raises(CheckpointError):
            GGUFFile(_write(tmp_path, blob[:cut]))


def test_missing_file_and_unsupported_content(tmp_path):
    with pytest.raises(CheckpointError):
        open_checkpoint(str(tmp_path / "nope.gguf"))
    path = _write(tmp_path, gguf_bytes(kvs=[_kv("general.architecture", 8, _str("mamba"))]))
    with pytest.raises(CheckpointError, match="architecture 'mamba'"):
        open_checkpoint(path)
    path = _write(tmp_path, gguf_bytes(kvs=[_kv("tokenizer.ggml.model", 8, _str("llama"))]))
    with pytest.raises(CheckpointError, match="tokenizer.ggml.tokens"):   # SentencePiece, but no vocabulary
        load_tokenizer(path)
    path = _write(tmp_path, gguf_bytes(kvs=[_kv("tokenizer.ggml.model", 8, _str("t5"))]))
    with pytest.raises(CheckpointError, match="tokenizer model 't5'.*not supported"):
        load_tokenizer(path)


def test_llama_missing_metadata_names_the_key(tmp_path):
    with pytest.raises(CheckpointError, match="llama.embedding_length"):
        open_checkpoint(_write(tmp_path, gguf_bytes()))
