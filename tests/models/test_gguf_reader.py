"""A tiny llama GGUF written with `gguf.GGUFWriter` parses back exactly, in HF layout."""

import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from tokenmill.models.loader import CheckpointError, load_tokenizer, open_checkpoint  # noqa: E402
from tokenmill.models.loader.gguf_llama import permute_rope_rows, unpermute_rope_rows  # noqa: E402
from tokenmill.models.loader.gguf_reader import GGUFFile  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 4, 2, 16, 96, 2
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_tokens() -> list[str]:
    from tokenmill.models.loader.gguf_tokenizer import byte_alphabet
    return [byte_alphabet()[b] for b in range(256)]


def _vocab() -> tuple[list[str], list[str], list[int]]:
    merges = ["Ġ t", "h e", "Ġt he", "l l", "i n", "Ġ a"]
    tokens = CONTROL + _byte_tokens() + ["Ġt", "he", "Ġthe", "ll", "in", "Ġa", "<think>"]
    types = [3] * len(CONTROL) + [1] * (len(tokens) - len(CONTROL) - 1) + [4]
    return tokens, merges, types


def _hf_weights(rng) -> dict[str, np.ndarray]:
    """HF-layout float32 weights for a 2-layer llama (lm_head present: untied)."""
    vocab = len(_vocab()[0])
    w = {"model.embed_tokens.weight": (vocab, HIDDEN), "model.norm.weight": (HIDDEN,), "lm_head.weight": (vocab, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w.update({p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
                  p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                  p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                  p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
                  p + "mlp.gate_proj.weight": (FFN, HIDDEN), p + "mlp.up_proj.weight": (FFN, HIDDEN),
                  p + "mlp.down_proj.weight": (HIDDEN, FFN),
                  p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,)})
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in w.items()}


# (gguf name, HF name, how stored); q/k stay float so the un-permutation is checked exactly
def _layout() -> list[tuple[str, str, Q]]:
    out = [("token_embd.weight", "model.embed_tokens.weight", Q.Q8_0),
           ("output_norm.weight", "model.norm.weight", Q.F32), ("output.weight", "lm_head.weight", Q.BF16)]
    kinds = [("attn_q", "self_attn.q_proj", Q.F32), ("attn_k", "self_attn.k_proj", Q.F16),
             ("attn_v", "self_attn.v_proj", Q.Q4_0), ("attn_output", "self_attn.o_proj", Q.Q4_1),
             ("ffn_gate", "mlp.gate_proj", Q.Q8_0), ("ffn_up", "mlp.up_proj", Q.Q4_1),
             ("ffn_down", "mlp.down_proj", Q.F16), ("attn_norm", "input_layernorm", Q.F32),
             ("ffn_norm", "post_attention_layernorm", Q.F32)]
    for i in range(LAYERS):
        out += [(f"blk.{i}.{g}.weight", f"model.layers.{i}.{h}.weight", q) for g, h, q in kinds]
    return out


def write_tiny_llama(path, rng) -> dict[str, np.ndarray]:
    """Write the GGUF; return the float32 values our loader must produce (HF layout)."""
    hf = _hf_weights(rng)
    tokens, merges, types = _vocab()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS); w.add_embedding_length(HIDDEN); w.add_feed_forward_length(FFN)  # noqa: E702
    w.add_head_count(HEADS); w.add_head_count_kv(KV_HEADS); w.add_rope_freq_base(500000.0)  # noqa: E702
    w.add_layer_norm_rms_eps(1e-6); w.add_context_length(256); w.add_rope_dimension_count(HEAD_DIM)  # noqa: E702
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("llama-bpe"); w.add_token_list(tokens)  # noqa: E702
    w.add_token_merges(merges); w.add_token_types(types); w.add_bos_token_id(1); w.add_eos_token_id(2)  # noqa: E702
    w.add_add_bos_token(True); w.add_chat_template("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")  # noqa: E702
    expected = {}
    for gname, hname, qtype in _layout():
        values = hf[hname]
        if ".attn_q." in gname or ".attn_k." in gname:
            values = permute_rope_rows(values, HEADS if ".attn_q." in gname else KV_HEADS)
        stored = _store(values, qtype)
        w.add_tensor(gname, stored, raw_dtype=qtype)
        if qtype in (Q.F32, Q.F16):  # rounding commutes with the row permutation: compare to HF order
            expected[hname] = _store(hf[hname], qtype).astype(np.float32)
        else:
            expected[hname] = gguf.quants.dequantize(stored, qtype).reshape(values.shape)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702
    return expected


def _store(values: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.F32:
        return values
    if qtype == Q.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values, qtype)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    expected = write_tiny_llama(path, np.random.default_rng(0))
    return str(path), expected


def test_metadata_matches_gguf_reader(tiny_gguf):
    path, _ = tiny_gguf
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    assert ours.version == 3 and ours.alignment == 32
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        assert ours.metadata[key] == pytest.approx(value) if isinstance(value, float) else ours.metadata[key] == value, key
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.dims == tuple(int(d) for d in t.shape) and info.type_id == int(t.tensor_type)
        assert info.offset == t.data_offset and info.nbytes == t.n_bytes


def test_config_from_metadata(tiny_gguf):
    cfg = open_checkpoint(tiny_gguf[0]).hf_config
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (LAYERS, HIDDEN, FFN)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (HEADS, KV_HEADS, HEAD_DIM)
    assert cfg["rope_theta"] == 500000.0 and cfg["max_position_embeddings"] == 256
    assert cfg["vocab_size"] == len(_vocab()[0]) and cfg["tie_word_embeddings"] is False
    assert cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2 and cfg["rope_scaling"] is None


def test_tensors_in_hf_layout(tiny_gguf):
    path, expected = tiny_gguf
    ckpt = open_checkpoint(path)
    got = dict(ckpt.iter_tensors())
    assert set(got) == set(expected)
    for name, values in expected.items():
        assert got[name].dtype == torch.float32 and tuple(got[name].shape) == values.shape, name
        np.testing.assert_array_equal(got[name].numpy(), values, err_msg=name)
    assert ckpt.weight_bytes() == sum(t.n_bytes for t in gguf.GGUFReader(path).tensors)


@pytest.mark.parametrize("rows,heads", [(64, 4), (32, 2), (12, 3), (128, 1)])
def test_unpermute_inverts_llama_cpp_permute(rows, heads):
    w = np.random.default_rng(rows).standard_normal((rows, 8)).astype(np.float32)
    permuted = permute_rope_rows(w, heads)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, heads), w)
    np.testing.assert_array_equal(unpermute_rope_rows(permute_rope_rows(w[:, 0], heads), heads), w[:, 0])


def test_tiny_tokenizer_matches_transformers(tiny_gguf):
    transformers = pytest.importorskip("transformers")
    path = tiny_gguf[0]
    ours = load_tokenizer(path)
    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    for text in ["the theme", "<|im_start|>hello<|im_end|>", "in <think>all</think>", "Ünïcode 🙂 x", "  the\n\tthe"]:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.encode(text)[0] == 1  # add_bos_token=True in the metadata
        ids = ours.encode(text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)


def test_every_metadata_value_type(tmp_path):
    T = gguf.GGUFValueType
    values = {"u8": (255, T.UINT8), "i8": (-128, T.INT8), "u16": (65535, T.UINT16), "i16": (-32768, T.INT16),
              "u32": (2**32 - 1, T.UINT32), "i32": (-2**31, T.INT32), "f32": (1.5, T.FLOAT32), "b": (True, T.BOOL),
              "s": ("héllo ✓", T.STRING), "u64": (2**64 - 1, T.UINT64), "i64": (-2**63, T.INT64), "f64": (0.1, T.FLOAT64)}
    path = str(tmp_path / "kv.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for key, (value, vtype) in values.items():
        w.add_key_value(key, value, vtype)
    w.add_array("arr_f", [0.5, -2.0]); w.add_array("arr_b", [True, False]); w.add_array("arr_s", ["a", "", "ü"])  # noqa: E702
    w.add_array("nested", [[1, 2], [3]])
    w.add_custom_alignment(64)
    w.add_tensor("t", np.arange(32, dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702
    md = GGUFFile(path).metadata
    for key, (value, _) in values.items():
        assert md[key] == value, key
    assert md["arr_f"] == [0.5, -2.0] and md["arr_b"] == [True, False] and md["arr_s"] == ["a", "", "ü"]
    assert md["nested"] == [[1, 2], [3]]
    f = GGUFFile(path)
    assert f.alignment == 64 and f.data_offset % 64 == 0
    np.testing.assert_array_equal(f.dequantize("t"), np.arange(32, dtype=np.float32))


def _rewrite(src: str, dst: str, drop=(), **kv_overrides) -> str:
    """Copy a GGUF through GGUFReader -> GGUFWriter, dropping tensors / overriding u32 KVs."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, "llama")
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = kv_overrides.get(key, field.contents())
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, vtype)
    for t in r.tensors:
        if t.name not in drop:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702
    return dst


@pytest.mark.parametrize("drop,overrides,message", [
    (("blk.1.ffn_up.weight",), {}, "missing tensors: model.layers.1.mlp.up_proj.weight"),
    ((), {"llama.block_count": 1}, "blk.1"),
    ((), {"llama.block_count": 10**9}, "cannot hold"),
    ((), {"llama.feed_forward_length": 128}, "blk.0.ffn_gate.weight"),
    ((), {"llama.attention.head_count_kv": 4}, "blk.0.attn_k.weight"),
])
def test_tensors_inconsistent_with_config(tiny_gguf, tmp_path, drop, overrides, message):
    path = _rewrite(tiny_gguf[0], str(tmp_path / "bad.gguf"), drop, **overrides)
    with pytest.raises(CheckpointError, match=message):
        open_checkpoint(path)
