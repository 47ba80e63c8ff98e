"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF): config, tokenizer, chat template."""

import os

import numpy as np
import pytest

from tokenmill.models.hub import resolve_model
from tokenmill.models.loader import load_tokenizer, open_checkpoint

TEXTS = [
    "Hello, world!", "", " ", "   leading and trailing   ", "\n\n\tTabs\tand\nnewlines\r\n",
    "The quick brown fox jumps over the lazy dog.", "naïve café — déjà vu, Straße, Ångström",
    "日本語のテキストと中文字符", "emoji 🙂🚀👩‍👩‍👧 mix", "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i]; }", "12345 67890 3.14159 1e-10 0xFF",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", "text<|endoftext|>more text",
    "<repo_name>x<file_sep>y", "I'm sure they'll say it's fine, won't they?", "a" * 50,
    "URL: https://example.com/path?q=1&r=2#frag", "Mixed   spaces\u00a0and\u2003unicode spaces",
    "<|im_start|", "Ｆｕｌｌｗｉｄｔｈ ＡＢＣ",
]


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return resolve_model("smollm2-135m")
    except Exception as e:  # offline machine without the cache: nothing to test against
        pytest.skip(f"SmolLM2 GGUF not cached and not fetchable: {e}")


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path):
    transformers = pytest.importorskip("transformers")
    directory, name = os.path.split(gguf_path)
    return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)


def test_config(gguf_path):
    ckpt = open_checkpoint(gguf_path)
    cfg = ckpt.hf_config
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576 and cfg["intermediate_size"] == 1536
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 100000.0 and cfg["max_position_embeddings"] == 8192
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)
    assert ckpt.weight_bytes() < os.path.getsize(gguf_path)


def test_some_tensors_match_gguf_reference(gguf_path):
    gguf = pytest.importorskip("gguf")
    ref = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    ckpt = open_checkpoint(gguf_path)
    for gname in ("token_embd.weight", "blk.3.ffn_down.weight", "blk.0.attn_v.weight", "output_norm.weight"):
        expected = gguf.quants.dequantize(ref[gname].data, ref[gname].tensor_type)
        np.testing.assert_array_equal(ckpt.gguf.dequantize(gname), expected, err_msg=gname)
    names = [n for n, _ in ckpt.iter_tensors()]
    assert len(names) == 1 + 30 * 9 + 1 and "lm_head.weight" not in names
    assert "model.layers.29.self_attn.k_proj.weight" in names


def test_tokenizer_matches_transformers(gguf_path, hf_tokenizer):
    ours = load_tokenizer(gguf_path)
    assert ours.vocab_size == len(hf_tokenizer) == 49152
    assert (ours.bos_token_id, ours.eos_token_id, ours.eos_token_ids) == (1, 2, [2])
    assert ours.all_special_ids >= set(range(17))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        assert ours.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids), text
        assert ours.convert_ids_to_tokens(ids) == hf_tokenizer.convert_ids_to_tokens(ids)
    assert ours.encode("<|im_start|>") == [1]  # control tokens stay whole, and no BOS is added


def test_chat_template_matches_transformers(gguf_path, hf_tokenizer):
    ours = load_tokenizer(gguf_path)
    chats = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye 🙂"}],
    ]
    for messages in chats:
        for gen in (True, False):
            expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected
            ids = ours.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
            assert ids == hf_tokenizer.encode(expected, add_special_tokens=False)
            assert ids.count(ours.bos_token_id) == expected.count("<|im_start|>")
