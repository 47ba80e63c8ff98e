"""Malformed GGUF files fail fast with CheckpointError: no crash, hang or huge allocation."""

import random
import struct

import numpy as np
import pytest

from tokenmill.models.loader import CheckpointError, load_tokenizer, open_checkpoint
from tokenmill.models.loader.gguf_quants import GGML_TYPES
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


def _u32(key: str, value: int) -> bytes:
    return _kv(key, 4, struct.pack("<I", value))


def _strings(key: str, items: list[str]) -> bytes:
    return _kv(key, 9, struct.pack("<IQ", 8, len(items)) + b"".join(_str(t) for t in items))


def _i32s(key: str, items: list[int]) -> bytes:
    return _kv(key, 9, struct.pack("<IQ", 5, len(items)) + struct.pack(f"<{len(items)}i", *items))


def gguf_file(kvs: list[bytes], tensors: list[tuple[str, list[int], int]], rng) -> tuple[bytes, int]:
    """A valid GGUF whose tensors (name, GGUF dims, ggml type id) hold ``rng``'s random bytes;
    returns it and where its tensor data starts."""
    infos, offset = [], 0
    for name, dims, type_id in tensors:
        infos.append(_tensor(name, dims, type_id, offset))
        t = GGML_TYPES[type_id]
        offset += -(-int(np.prod(dims)) // t.block_size * t.type_size // 32) * 32
    head = b"GGUF" + struct.pack("<IQQ", 3, len(infos), len(kvs)) + b"".join(kvs) + b"".join(infos)
    head += b"\0" * (-len(head) % 32)
    return head + rng.randbytes(offset), len(head)


LLAMA_LAYER = [("attn_norm", [32], 0), ("ffn_norm", [32], 1), ("attn_q", [32, 32], 3), ("attn_k", [32, 16], 6),
               ("attn_v", [32, 16], 7), ("attn_output", [32, 32], 30), ("ffn_gate", [32, 32], 8),
               ("ffn_up", [32, 32], 1), ("ffn_down", [32, 32], 0)]


def tiny_llama_gguf(rng, extra_tensors=()) -> tuple[bytes, int]:
    """A complete 1-layer llama (hidden 32, 2 heads, 1 KV head) in nine tensor types with a
    byte-level BPE tokenizer, so every stage of a load runs on it."""
    kvs = [_kv("general.architecture", 8, _str("llama")), _u32("llama.embedding_length", 32),
           _u32("llama.block_count", 1), _u32("llama.feed_forward_length", 32),
           _u32("llama.attention.head_count", 2), _u32("llama.attention.head_count_kv", 1),
           _u32("llama.context_length", 64), _kv("llama.rope.freq_base", 6, struct.pack("<f", 1e4)),
           _kv("tokenizer.ggml.model", 8, _str("gpt2")), _kv("tokenizer.ggml.pre", 8, _str("llama-bpe")),
           _strings("tokenizer.ggml.tokens", ["a", "b", "c", "ab", "\u0120", "\u0120a", "<s>", "</s>"]),
           _strings("tokenizer.ggml.merges", ["a b", "\u0120 a"]),
           _i32s("tokenizer.ggml.token_type", [1, 1, 1, 1, 1, 1, 3, 3]),
           _u32("tokenizer.ggml.bos_token_id", 6), _u32("tokenizer.ggml.eos_token_id", 7)]
    tensors = [("token_embd.weight", [32, 8], 8), ("output_norm.weight", [32], 0), ("output.weight", [32, 8], 2)]
    layer = [(f"blk.0.{kind}.weight", dims, t) for kind, dims, t in LLAMA_LAYER]
    return gguf_file(kvs, tensors + layer + list(extra_tensors), rng)


def every_type_gguf(rng) -> tuple[bytes, int]:
    """One tensor of every GGML type (K-quants too) and a SentencePiece tokenizer."""
    kvs = [_kv("general.architecture", 8, _str("fuzz")), _kv("tokenizer.ggml.model", 8, _str("llama")),
           _strings("tokenizer.ggml.tokens", ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "\u2581a", "ab"]),
           _kv("tokenizer.ggml.scores", 9, struct.pack("<IQ", 6, 8) + np.arange(8, dtype="<f4").tobytes()),
           _i32s("tokenizer.ggml.token_type", [2, 3, 3, 1, 1, 1, 1, 1]),
           _u32("tokenizer.ggml.bos_token_id", 1), _u32("tokenizer.ggml.eos_token_id", 2)]
    return gguf_file(kvs, [(f"t{i}", [GGML_TYPES[i].block_size * 2], i) for i in sorted(GGML_TYPES)], rng)


def _write(tmp_path, blob: bytes) -> str:
    path = tmp_path / "bad.gguf"
    path.write_bytes(blob)
    return str(path)


def test_hand_encoded_baseline_is_valid(tmp_path):
    f = GGUFFile(_write(tmp_path, gguf_bytes()))
    np.testing.assert_array_equal(f.dequantize("w"), np.arange(8, dtype=np.float32))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random bytes dequantize to NaN and inf
def test_hand_encoded_llama_loads_whole(tmp_path):
    """The fuzzer's seed files load through every stage (so its mutations start deep)."""
    path = _write(tmp_path, tiny_llama_gguf(random.Random(0))[0])
    assert len(list(open_checkpoint(path).iter_tensors())) == 12
    assert load_tokenizer(path).encode("ab a") == [3, 5]
    gguf = GGUFFile(_write(tmp_path, every_type_gguf(random.Random(0))[0]))
    assert all(gguf.dequantize(name).size == 2 * GGML_TYPES[gguf.tensors[name].type_id].block_size for name in gguf.tensors)
    assert load_tokenizer(gguf.path).encode("ab a") == [1, 3, 7, 6]  # <s> ▁ ab ▁a


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
