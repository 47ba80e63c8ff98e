"""HF directories: tiny random transformers models saved with save_pretrained load exactly."""

import json
import struct

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tokenmill.models.loader import CheckpointError, load_tokenizer, open_checkpoint  # noqa: E402


def _tiny_llama(dtype=torch.float32, tie=False):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=tie, rope_theta=50000.0)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


@pytest.mark.parametrize("shard", [None, "40KB"])
def test_safetensors_dir_equals_state_dict(tmp_path, shard):
    model = _tiny_llama()
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path, **kwargs)
    ckpt = open_checkpoint(str(tmp_path))
    if shard:
        assert len(ckpt.files) > 1
    got = dict(ckpt.iter_tensors())
    expected = model.state_dict()
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], value), name
    assert ckpt.weight_bytes() == sum(v.numel() * 4 for v in expected.values())
    cfg = ckpt.hf_config
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_key_value_heads"], cfg["head_dim"]) == (2, 64, 2, 16)
    assert cfg["rope_theta"] == 50000.0 and cfg["rope_scaling"] is None and cfg["tie_word_embeddings"] is False


def test_bf16_checkpoint_is_cast_to_float32(tmp_path):
    model = _tiny_llama(torch.bfloat16, tie=True)
    model.save_pretrained(tmp_path)
    ckpt = open_checkpoint(str(tmp_path))
    got = dict(ckpt.iter_tensors())
    assert "lm_head.weight" not in got and ckpt.hf_config["tie_word_embeddings"] is True
    for name, value in model.state_dict().items():
        if name in got:
            assert torch.equal(got[name], value.float()), name
    assert ckpt.weight_bytes() == sum(v.numel() * 2 for v in got.values())


def test_remote_code_is_never_run(tmp_path):
    _tiny_llama().save_pretrained(tmp_path)
    sentinel = tmp_path / "ran"
    (tmp_path / "modeling_evil.py").write_text(f"open({str(sentinel)!r}, 'w').write('x')\n")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ckpt = open_checkpoint(str(tmp_path))
    list(ckpt.iter_tensors())
    assert not sentinel.exists()


def _safetensors(tmp_path, header: bytes, data: bytes = b"", header_len=None):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8, "num_hidden_layers": 1,
                                                      "num_attention_heads": 1, "vocab_size": 4}))
    n = len(header) if header_len is None else header_len
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", n) + header + data)
    return str(tmp_path)


@pytest.mark.parametrize("header,data,header_len", [
    (b"{}", b"", 2**60),  # header longer than the file
    (b"not json", b"", None),
    (json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode(), b"\0" * 8, None),  # past end
    (json.dumps({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}).encode(), b"\0" * 16, None),  # dtype x shape
    (json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                 "v": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}).encode(), b"\0" * 24, None),  # overlap
    (json.dumps({"w": {"dtype": "XX", "shape": [4], "data_offsets": [0, 16]}}).encode(), b"\0" * 16, None),
])
def test_malformed_safetensors_raise(tmp_path, header, data, header_len):
    path = _safetensors(tmp_path, header, data, header_len)
    with pytest.raises(CheckpointError):
        ckpt = open_checkpoint(path)
        list(ckpt.iter_tensors())


def test_bad_directories(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        open_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="JSON object"):
        open_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8, "num_hidden_layers": 1,
                                                      "num_attention_heads": 1, "vocab_size": 4}))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        open_checkpoint(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../evil.safetensors"}}))
    with pytest.raises(CheckpointError, match="bad shard"):
        open_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))
