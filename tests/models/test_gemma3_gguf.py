"""The second real model (Gemma3-270M, Q4_K_M GGUF: Q4_K, Q5_0, Q6_K, Q8_0, F32 tensors):
config, dequantization, tokenizer and greedy output against HF transformers' float32
outputs stored in tests/data/gemma3_reference.json (see gemma3_reference.py)."""
import json

import numpy as np
import pytest

from tests.models.gemma3_reference import NUM_TOKENS, REFERENCE_PATH
from tokenmill.models.hub import resolve_model
from tokenmill.models.loader import open_checkpoint


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return resolve_model("gemma3-270m")
    except Exception as e:  # offline machine without the cache: nothing to test against
        pytest.skip(f"Gemma3 GGUF not cached and not fetchable: {e}")


@pytest.fixture(scope="module")
def reference():
    with open(REFERENCE_PATH) as f:
        return json.load(f)


def test_config(gguf_path):
    cfg = open_checkpoint(gguf_path).hf_config
    assert cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (18, 640, 2048)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 1, 256)
    assert cfg["vocab_size"] == 262144 and cfg["tie_word_embeddings"] is True
    assert cfg["sliding_window"] == 512 and cfg["rope_theta"] == 1e6
    assert [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"] == [5, 11, 17]


@pytest.mark.slow   # gguf.GGUFReader parses the 262k-token vocabulary in pure Python
def test_every_tensor_type_matches_gguf_reference(gguf_path):
    gguf = pytest.importorskip("gguf")
    ckpt = open_checkpoint(gguf_path)
    ref = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    by_type = {}
    for name, info in ckpt.gguf.tensors.items():
        by_type.setdefault(info.type_name, name)
    assert set(by_type) == {"F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    for name in by_type.values():
        expected = gguf.quants.dequantize(ref[name].data, ref[name].tensor_type)
        np.testing.assert_array_equal(ckpt.gguf.dequantize(name), expected, err_msg=name)


def test_norms_are_shifted_back(gguf_path):
    ckpt = open_checkpoint(gguf_path)
    from tokenmill.models.loader.gguf_llama import hf_tensor
    name, values = hf_tensor(ckpt.gguf, ckpt.hf_config, "blk.0.attn_q_norm.weight")
    assert name == "model.layers.0.self_attn.q_norm.weight"
    np.testing.assert_array_equal(values, ckpt.gguf.dequantize("blk.0.attn_q_norm.weight") - 1)


@pytest.mark.slow
def test_tokenizer_matches_transformers(gguf_path, reference):
    from tokenmill.models.loader import load_tokenizer
    ours = load_tokenizer(gguf_path)
    assert ours.vocab_size == reference["vocab_size"]
    assert (ours.bos_token_id, ours.eos_token_id) == (reference["bos_token_id"], reference["eos_token_id"])
    assert ours.chat_template == reference["chat_template"]   # the base model has none
    for entry in reference["texts"]:
        ids = ours.encode(entry["text"])
        assert ids == entry["ids"], entry["text"]
        assert ours.convert_ids_to_tokens(ids) == entry["tokens"]
        assert ours.decode(ids) == entry["decoded"]
        assert ours.decode(ids, skip_special_tokens=False) == entry["decoded_special"]
    for entry in reference["entries"]:
        assert ours.encode(entry["prompt"]) == entry["prompt_token_ids"]


@pytest.mark.slow
def test_greedy_matches_transformers(gguf_path, reference):
    from tokenmill import LLM
    _assert_greedy_matches(LLM(model=gguf_path, skip_tokenizer_init=True, max_model_len=512),
                           reference, atol=1e-3)


def _assert_greedy_matches(llm, reference, atol: float) -> None:
    """HF's greedy tokens for every reference prompt, their logprobs within ``atol``."""
    from tokenmill import SamplingParams
    entries = reference["entries"]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": e["prompt_token_ids"]} for e in entries], params, use_tqdm=False)
    for entry, out in zip(entries, outs):
        tokens = out.outputs[0].token_ids
        assert tokens == entry["token_ids"], entry["prompt"]
        ours = [lp[t].logprob for t, lp in zip(tokens, out.outputs[0].logprobs)]
        np.testing.assert_allclose(ours, entry["logprobs"], atol=atol)


@pytest.mark.slow
def test_packed_k_quants_give_the_same_greedy_output(gguf_path, reference):
    """quantization="gguf" keeps Q5_0 / Q4_K / Q8_0 blocks packed (Q6_K stays float): with
    float activations the same function up to summation order, so HF's greedy tokens."""
    from tokenmill import LLM
    llm = LLM(model=gguf_path, skip_tokenizer_init=True, max_model_len=512, quantization="gguf")
    model = llm.engine.model
    packed = {type(m.quant_method).__name__ for m in model.modules() if hasattr(m, "quant_method")}
    assert "GGUFMethod" in packed
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.packed[0].kind == "i8"    # Q5_0 q / k (and Q8_0 v)
    assert layer.self_attn.o_proj.packed[0].kind == "i4"      # Q4_K
    # the tied embedding reads the packed head's rows; no float table of the vocabulary
    from tokenmill.layers.quant.embedding import PackedEmbedding
    assert isinstance(model.model.embed_tokens, PackedEmbedding)
    table = (model.args.vocab_size, model.args.hidden_size)
    assert not any(tuple(p.shape) == table and p.is_floating_point() for p in model.parameters())
    _assert_greedy_matches(llm, reference, atol=2e-3)
