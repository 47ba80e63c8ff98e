"""Hostile checkpoints beyond the basic malformed-file cases: more crafted GGUF and
safetensors files, tensors that do not fit the config, and a bounded hypothesis fuzz of
the GGUF reader. Every failure must be a typed, readable error (CheckpointError / a
ValueError naming the tensor) raised quickly -- never a crash, hang or huge allocation."""
import json
import os
import struct
import tempfile
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.models.test_gguf_malformed import _kv, _str, _tensor, gguf_bytes
from tokenmill.models.loader import CheckpointError, open_checkpoint
from tokenmill.models.loader.gguf_reader import GGUFFile
from tokenmill.runner.model_loader import build_model


def _write(tmp_path, blob: bytes, name="bad.gguf") -> str:
    path = tmp_path / name
    path.write_bytes(blob)
    return str(path)


def _u32(key, v):
    return _kv(key, 4, struct.pack("<I", v))


def _gemma_kvs(layers=1, **over):
    """Just enough gemma3 metadata for hf_config; values overridable."""
    vals = {"embedding_length": 8, "block_count": layers, "feed_forward_length": 16,
            "attention.head_count": 1, "attention.sliding_window": 4, "attention.key_length": 8,
            "vocab_size": 4}
    vals.update(over)
    return [_kv("general.architecture", 8, _str("gemma3"))] + [_u32(f"gemma3.{k}", v) for k, v in vals.items()]


GGUF_CASES = {
    "invalid utf-8 tensor name": (lambda: gguf_bytes(tensors=[struct.pack("<Q", 2) + b"\xc3\x28" + struct.pack("<IQIQ", 1, 8, 0, 0)]), "UTF-8"),
    "tensor count lies (more than listed)": (lambda: gguf_bytes(num_tensors=3), None),
    "string array of truncated strings": (lambda: gguf_bytes(kvs=[_kv("k", 9, struct.pack("<IQ", 8, 3) + _str("a") + struct.pack("<Q", 99))]), "truncated"),
    "alignment is a string": (lambda: gguf_bytes(kvs=[_kv("general.alignment", 8, _str("32"))]), "alignment"),
    "dims product overflows u64": (lambda: gguf_bytes(tensors=[_tensor("w", [2**32, 2**32, 2**32], 0, 0)]), "larger than the file"),
    "q4_k row not whole blocks": (lambda: gguf_bytes(tensors=[_tensor("w", [128], 12, 0)]), "block size"),
    "offset overflow": (lambda: gguf_bytes(tensors=[_tensor("w", [8], 0, 2**64 - 32)]), "past the end"),
    "only a header": (lambda: b"GGUF" + struct.pack("<IQQ", 3, 0, 0), None),
}


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_more_malformed_gguf(tmp_path, case):
    make, message = GGUF_CASES[case]
    start = time.perf_counter()
    try:
        GGUFFile(_write(tmp_path, make()))
    except CheckpointError as e:
        assert message is None or message in str(e)
    else:
        assert message is None  # a file that is merely empty of tensors may parse
    assert time.perf_counter() - start < 1.0


METADATA_CASES = {
    "gemma3 without sliding window": (lambda: [kv for kv in _gemma_kvs() if b"sliding" not in kv], "sliding_window"),
    "gemma3 absurd layer count": (lambda: _gemma_kvs(layers=10**9), "cannot hold"),
    "gemma3 zero heads": (lambda: _gemma_kvs(**{"attention.head_count": 0}), "positive"),
    "gemma3 embedding length as string": (lambda: _gemma_kvs()[:1] + [_kv("gemma3.embedding_length", 8, _str("8"))], "embedding_length"),
    "head count not a multiple of kv heads": (lambda: _gemma_kvs(**{"attention.head_count": 3, "attention.head_count_kv": 2}), "multiple"),
}


@pytest.mark.parametrize("case", sorted(METADATA_CASES))
def test_lying_metadata_fails_at_open(tmp_path, case):
    make, message = METADATA_CASES[case]
    with pytest.raises(CheckpointError, match=message):
        open_checkpoint(_write(tmp_path, gguf_bytes(kvs=make())))


def _safetensors_dir(tmp_path, header: dict, data: bytes, raw_header: bytes = None) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8, "num_hidden_layers": 1,
                                                      "num_attention_heads": 1, "vocab_size": 4}))
    blob = raw_header if raw_header is not None else json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return str(tmp_path)


F32_4 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
SAFETENSORS_CASES = {
    "reversed offsets": ({"w": {**F32_4, "data_offsets": [16, 0]}}, b"\0" * 16),
    "gap between tensors": ({"w": F32_4, "v": {**F32_4, "data_offsets": [32, 48]}}, b"\0" * 48),
    "huge shape": ({"w": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 16]}}, b"\0" * 16),
    "negative dim": ({"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, b"\0" * 16),
    "offsets not a list": ({"w": {**F32_4, "data_offsets": "0-16"}}, b"\0" * 16),
    "metadata not strings": ({"__metadata__": {"a": 1}, "w": F32_4}, b"\0" * 16),
    "trailing bytes after data": ({"w": F32_4}, b"\0" * 20),
}


@pytest.mark.parametrize("case", sorted(SAFETENSORS_CASES))
def test_more_malformed_safetensors(tmp_path, case):
    header, data = SAFETENSORS_CASES[case]
    with pytest.raises(CheckpointError):
        list(open_checkpoint(_safetensors_dir(tmp_path, header, data)).iter_tensors())


def test_header_length_beyond_file_is_refused_before_reading(tmp_path):
    path = _safetensors_dir(tmp_path, {}, b"", raw_header=b"{}")
    with open(os.path.join(path, "model.safetensors"), "r+b") as f:
        f.write(struct.pack("<Q", 2**40))   # a 1 TB header in a 10-byte file
    with pytest.raises(CheckpointError, match="exceeds the file size"):
        list(open_checkpoint(path).iter_tensors())


def _tiny_llama_checkpoint(tmp_path, mutate):
    """A saved tiny Llama whose state dict ``mutate`` edits before writing."""
    import torch
    import transformers
    from safetensors.torch import save_file
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    cfg.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    mutate(state)
    save_file(state, str(tmp_path / "model.safetensors"))
    return open_checkpoint(str(tmp_path))


@pytest.mark.parametrize("mutate,message", [
    (lambda s: s.pop("model.layers.0.mlp.up_proj.weight"), "model.layers.0.mlp.up_proj.weight"),
    (lambda s: s.update({"model.layers.0.self_attn.k_proj.weight": s["model.layers.0.self_attn.q_proj.weight"].clone()}),
     "model.layers.0.self_attn.k_proj.weight"),
    (lambda s: s.update({"model.norm.weight": s["model.norm.weight"][:8]}), "model.norm.weight"),
    (lambda s: s.update({"model.layers.7.mlp.up_proj.weight": s["model.layers.0.mlp.up_proj.weight"].clone()}),
     "model.layers.7.mlp.up_proj.weight"),
])
def test_tensors_not_fitting_the_config_name_the_tensor(tmp_path, mutate, message):
    import torch
    ckpt = _tiny_llama_checkpoint(tmp_path, mutate)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        build_model(ckpt, torch.device("cpu"), torch.float32, 64)


def _valid_gguf() -> bytes:
    kvs = [_kv("general.architecture", 8, _str("llama")), _kv("a", 9, struct.pack("<IQ", 8, 2) + _str("x") + _str("yz")),
           _u32("general.alignment", 32)]
    tensors = [_tensor("w", [32], 8, 0), _tensor("v", [8], 0, 64)]
    data = np.zeros(34, np.uint8).tobytes() + b"\0" * 30 + np.arange(8, dtype=np.float32).tobytes()
    return gguf_bytes(kvs=kvs, tensors=tensors, data=data)


VALID = _valid_gguf()


@settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(edits=st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), max_size=8),
       cut=st.integers(0, len(VALID)), insert=st.binary(max_size=16), at=st.integers(0, len(VALID)))
def test_fuzz_gguf_reader(edits, cut, insert, at):
    blob = bytearray(VALID)
    for pos, value in edits:
        blob[pos] = value
    blob = bytes(blob[:at]) + insert + bytes(blob[at:])
    blob = blob[:cut + len(insert)]
    fd, path = tempfile.mkstemp(suffix=".gguf")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        try:
            gguf = GGUFFile(path)
            for name in gguf.tensors:
                gguf.dequantize(name)
        except CheckpointError as e:
            assert str(e)
    finally:
        os.unlink(path)
