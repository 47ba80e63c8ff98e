"""`tokenmill upcycle`: dense Llama -> Mixtral checkpoint, checked against HF transformers.

With identical experts (perturb 0) transformers' MixtralForCausalLM on the output must give
the dense LlamaForCausalLM's logits; the rest checks names, config, seeds, the tokenizer and
the command line's refusals.
"""

import json
import math
import os

import pytest
import torch
from safetensors import safe_open

from tests.conftest import save_tiny_llama
from tokenmill.entrypoints.cli import main
from tokenmill.models.loader import load_tokenizer, open_checkpoint
from tokenmill.models.upcycle import (ROUTER_INIT_STD, UpcycleConfig, UpcycleError, expert_name,
                                      router_name, router_weight, upcycle)

transformers = pytest.importorskip("transformers")

HIDDEN, FFN, LAYERS, VOCAB = 64, 128, 2, 384


def _dense(path, tied=False):
    model = save_tiny_llama(path, seed=3, tie_word_embeddings=tied)
    return str(path), model


def _tensors(directory) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(directory, "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (1, 1), generator=g), torch.randint(0, VOCAB, (1, 13), generator=g),
            torch.randint(0, VOCAB, (3, 29), generator=g)]


@pytest.mark.parametrize("tied", [False, True])
def test_identical_experts_give_the_dense_logits(tmp_path, tied):
    src, dense = _dense(tmp_path / "dense", tied)
    out = str(tmp_path / "moe")
    upcycle(src, out, UpcycleConfig(num_experts=4, top_k=2))
    moe = transformers.MixtralForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert len(moe.model.layers) == LAYERS and moe.config.num_local_experts == 4
    for ids in _inputs():
        expected = _logits(dense, ids)
        assert expected.abs().max() > 1  # a real signal, not a model that outputs ~0
        torch.testing.assert_close(_logits(moe, ids), expected, rtol=0, atol=1e-5)


def test_tensor_names_and_copies(tmp_path):
    src, _ = _dense(tmp_path / "dense")
    out = str(tmp_path / "moe")
    summary = upcycle(src, out, UpcycleConfig(num_experts=4, top_k=2, seed=5))
    source = dict(open_checkpoint(src).iter_tensors())
    written = _tensors(out)
    renamed = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    expected_names = {n for n in source if ".mlp." not in n}
    for i in range(LAYERS):
        expected_names.add(router_name(i))
        for e in range(4):
            for proj, short in renamed.items():
                name = expert_name(i, e, proj)
                assert name == f"model.layers.{i}.block_sparse_moe.experts.{e}.{short}.weight"
                assert torch.equal(written[name], source[f"model.layers.{i}.mlp.{proj}.weight"]), name
                expected_names.add(name)
        router = written[router_name(i)]
        assert router.shape == (4, HIDDEN)
        assert torch.equal(router, router_weight(5, i, 4, HIDDEN))
    assert set(written) == expected_names and "lm_head.weight" in written
    for name in expected_names:
        if name in source:
            assert torch.equal(written[name], source[name]), name
    routers = torch.cat([written[router_name(i)] for i in range(LAYERS)])
    assert 0.5 * ROUTER_INIT_STD < routers.std() < 1.5 * ROUTER_INIT_STD
    assert not torch.equal(written[router_name(0)], written[router_name(1)])
    per_expert = 3 * HIDDEN * FFN
    assert summary.total_params == sum(t.numel() for t in written.values())
    assert summary.total_params - summary.active_params == LAYERS * 2 * per_expert


def test_config_fields(tmp_path):
    src, _ = _dense(tmp_path / "dense", tied=True)
    out = str(tmp_path / "moe")
    upcycle(src, out, UpcycleConfig(num_experts=4, top_k=2))
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(src, "config.json")) as f:
        dense = json.load(f)
    assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["model_type"] == "mixtral"
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                "eos_token_id", "hidden_act"):
        assert cfg[key] == dense[key], key
    assert cfg["intermediate_size"] == FFN and cfg["tie_word_embeddings"] is True
    assert cfg["rope_parameters"]["rope_theta"] == dense["rope_parameters"]["rope_theta"] == cfg["rope_theta"]
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (4, 2)
    assert cfg["sliding_window"] is None and cfg["output_router_logits"] is False
    assert cfg["router_aux_loss_coef"] > 0 and cfg["dtype"] == "float32"
    assert "lm_head.weight" not in _tensors(out)  # tied: the head stays the embedding
    hf = transformers.AutoConfig.from_pretrained(out)
    assert type(hf).__name__ == "MixtralConfig" and hf.rope_parameters["rope_theta"] == 10000.0
    with open(os.path.join(out, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == 2


def test_perturbed_experts_differ_and_are_seeded(tmp_path):
    src, dense = _dense(tmp_path / "dense")
    p = 0.05
    out = str(tmp_path / "moe")
    upcycle(src, out, UpcycleConfig(num_experts=4, top_k=2, perturb=p, seed=11))
    w = _tensors(out)
    base = dict(open_checkpoint(src).iter_tensors())["model.layers.1.mlp.up_proj.weight"]
    experts = [w[expert_name(1, e, "up_proj")] for e in range(4)]
    for e, x in enumerate(experts):
        ratio = x / base
        assert abs(float((ratio - 1).std()) - p) < 0.1 * p, e  # the noise is p * N(0, 1)
        assert abs(float((ratio - 1).mean())) < 0.1 * p
        for other in experts[:e]:
            assert not torch.allclose(x, other)
    moe = transformers.MixtralForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = _inputs()[2]
    assert (_logits(moe, ids) - _logits(dense, ids)).abs().max() > 1e-3
    # Per-expert streams: the same seed gives the same experts, whatever the expert count.
    out2 = str(tmp_path / "moe2")
    upcycle(src, out2, UpcycleConfig(num_experts=2, top_k=1, perturb=p, seed=11))
    w2 = _tensors(out2)
    for e in range(2):
        assert torch.equal(w2[expert_name(0, e, "down_proj")], w[expert_name(0, e, "down_proj")])
    out3 = str(tmp_path / "moe3")
    upcycle(src, out3, UpcycleConfig(num_experts=2, top_k=1, perturb=p, seed=12))
    assert not torch.equal(_tensors(out3)[expert_name(0, 0, "gate_proj")], w[expert_name(0, 0, "gate_proj")])


def test_bfloat16_output(tmp_path):
    src, _ = _dense(tmp_path / "dense")
    out = str(tmp_path / "moe")
    summary = upcycle(src, out, UpcycleConfig(num_experts=2, top_k=1, dtype="bfloat16"))
    w = _tensors(out)
    assert {t.dtype for t in w.values()} == {torch.bfloat16}
    assert summary.num_bytes == 2 * sum(t.numel() for t in w.values())
    source = dict(open_checkpoint(src).iter_tensors())
    assert torch.equal(w[expert_name(0, 1, "gate_proj")], source["model.layers.0.mlp.gate_proj.weight"].bfloat16())


def test_cli_writes_and_summarises(tmp_path, capsys):
    src, _ = _dense(tmp_path / "dense")
    out = str(tmp_path / "moe")
    assert main(["upcycle", "--experts", "4", "--top-k", "2", "--perturb", "0.01", "--seed", "3", src, out]) == 0
    line = capsys.readouterr().out.strip()
    assert "4 experts" in line and "top-2" in line and "total" in line and "active per token" in line
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["num_local_experts"] == 4
    assert sorted(os.listdir(tmp_path)) == ["dense", "moe"]  # no temp directory left behind


def test_refuses_to_overwrite_without_force(tmp_path, capsys):
    src, _ = _dense(tmp_path / "dense")
    out = tmp_path / "moe"
    out.mkdir()
    assert main(["upcycle", "--experts", "2", "--top-k", "1", src, str(out)]) == 0  # empty: fine
    (out / "keep.txt").write_text("mine")
    before = _tensors(str(out))
    assert main(["upcycle", "--experts", "3", "--top-k", "1", src, str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine" and _tensors(str(out)).keys() == before.keys()
    assert main(["upcycle", "--experts", "3", "--top-k", "1", "--force", src, str(out)]) == 0
    assert not (out / "keep.txt").exists() and expert_name(0, 2, "up_proj") in _tensors(str(out))
    assert sorted(os.listdir(tmp_path)) == ["dense", "moe"]
    assert main(["upcycle", "--experts", "2", "--top-k", "1", "--force", src, src]) == 2  # never the source
    assert "source model" in capsys.readouterr().err and os.path.isfile(os.path.join(src, "model.safetensors"))


@pytest.mark.parametrize("flags, message", [
    (["--experts", "0", "--top-k", "1"], "--experts"),
    (["--experts", "-2", "--top-k", "1"], "--experts"),
    (["--experts", "4", "--top-k", "0"], "--top-k must be in [1, 4]"),
    (["--experts", "4", "--top-k", "5"], "--top-k must be in [1, 4]"),
    (["--experts", "4", "--top-k", "2", "--perturb", "-0.1"], "--perturb"),
    (["--experts", "4", "--top-k", "2", "--perturb", "nan"], "--perturb"),
    (["--experts", "4", "--top-k", "2", "--seed", "-1"], "--seed"),
])
def test_bad_arguments_are_clear_errors(tiny_llama_dir, tmp_path, capsys, flags, message):
    out = tmp_path / "moe"
    assert main(["upcycle", *flags, tiny_llama_dir, str(out)]) == 2
    assert message in capsys.readouterr().err and not out.exists()
    assert os.listdir(tmp_path) == []


def test_non_llama_sources_are_refused(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1)
    transformers.MistralForCausalLM(cfg).save_pretrained(tmp_path / "mistral")
    assert main(["upcycle", "--experts", "2", "--top-k", "1", str(tmp_path / "mistral"), str(tmp_path / "o")]) == 2
    assert "Llama" in capsys.readouterr().err and not (tmp_path / "o").exists()
    save_tiny_llama(tmp_path / "biased", attention_bias=True)
    with pytest.raises(UpcycleError, match="attention_bias"):
        upcycle(str(tmp_path / "biased"), str(tmp_path / "o"), UpcycleConfig(num_experts=2, top_k=1))
    assert sorted(os.listdir(tmp_path)) == ["biased", "mistral"]


def test_hf_tokenizer_files_are_copied(tmp_path):
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import models, pre_tokenizers
    src, _ = _dense(tmp_path / "dense")
    words = ["<s>", "</s>", "hello", "world", "again"]
    backend = BackendTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<s>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(os.path.join(src, "tokenizer.json"))
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    with open(os.path.join(src, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}, f)
    out = str(tmp_path / "moe")
    upcycle(src, out, UpcycleConfig(num_experts=2, top_k=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        with open(os.path.join(src, name), "rb") as a, open(os.path.join(out, name), "rb") as b:
            assert a.read() == b.read(), name
    tok = load_tokenizer(out)
    assert tok.encode("hello world again") == [2, 3, 4] and tok.chat_template == template
    dense_tok = load_tokenizer(src)
    assert (tok.bos_token_id, tok.eos_token_ids) == (dense_tok.bos_token_id, dense_tok.eos_token_ids) == (0, [1, 2])


def test_gguf_source(tmp_path):
    from tests.models.test_gguf_reader import LAYERS as G_LAYERS
    from tests.models.test_gguf_reader import write_tiny_llama
    import numpy as np
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_llama(path, np.random.default_rng(1))
    out = str(tmp_path / "moe")
    summary = upcycle(str(path), out, UpcycleConfig(num_experts=3, top_k=2))
    assert summary.dtype == "float32" and summary.num_layers == G_LAYERS
    w = _tensors(out)
    for i in range(G_LAYERS):
        for e in range(3):
            np.testing.assert_array_equal(w[expert_name(i, e, "up_proj")].numpy(),
                                          expected[f"model.layers.{i}.mlp.up_proj.weight"])
    np.testing.assert_array_equal(w["model.layers.0.self_attn.q_proj.weight"].numpy(),
                                  expected["model.layers.0.self_attn.q_proj.weight"])  # un-permuted, HF order
    source, written = load_tokenizer(str(path)), load_tokenizer(out)
    for text in ["the theme", "<|im_start|>hello<|im_end|>", "in <think>all</think>", "Ünïcode 🙂 x"]:
        assert written.encode(text) == source.encode(text) and written.encode(text)[0] == 1  # add_bos kept
    assert written.chat_template == source.chat_template
    assert (written.bos_token_id, written.eos_token_ids) == (source.bos_token_id, source.eos_token_ids)
    moe = transformers.MixtralForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert math.isfinite(float(_logits(moe, torch.tensor([[1, 5, 9]])).abs().max()))


@pytest.mark.slow
def test_default_model(tmp_path):
    from tests.models.test_smollm2_gguf import TEXTS
    from tokenmill.models.hub import resolve_model
    try:
        gguf_path = resolve_model("smollm2-135m")
    except Exception as e:  # offline machine without the cache: nothing to test against
        pytest.skip(f"SmolLM2 GGUF not cached and not fetchable: {e}")
    out = str(tmp_path / "smollm2-moe")
    assert main(["upcycle", "--experts", "2", "--top-k", "1", gguf_path, out]) == 0
    source, written = load_tokenizer(gguf_path), load_tokenizer(out)
    for text in TEXTS:
        ids = written.encode(text)
        assert ids == source.encode(text), text
        assert written.decode(ids) == source.decode(ids), text
    assert written.chat_template == source.chat_template and written.chat_template
    assert (written.bos_token_id, written.eos_token_ids, written.pad_token_id) == (1, [2], source.pad_token_id)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert written.apply_chat_template(messages, tokenize=True) == source.apply_chat_template(messages, tokenize=True)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)  # transformers reads it as well
    assert hf_tok("Hello, world!").input_ids == source.encode("Hello, world!")
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert (cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["tie_word_embeddings"]) == (30, 1536, True)
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        expert = f.get_tensor(expert_name(29, 1, "down_proj"))
    dense = next(t for n, t in open_checkpoint(gguf_path).iter_tensors() if n == "model.layers.29.mlp.down_proj.weight")
    assert torch.equal(expert, dense)
