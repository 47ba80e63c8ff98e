"""Device choice, backend names and random weights (load_format="dummy") from a config alone."""
import json

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import ModelConfig
from tokenmill.platform import pick_device


@pytest.mark.parametrize("field, value", [("device", "tpu"), ("attention_backend", "flash"),
                                          ("load_format", "pt"), ("enforce_eager", "yes")])
def test_model_config_rejects_unknown_values(field, value):
    with pytest.raises(ValueError, match=field):
        ModelConfig(model="m", **{field: value})


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_asking_for_cuda_without_a_gpu_is_a_clear_error():
    assert pick_device("auto").type == "cpu"
    assert pick_device("cpu").type == "cpu"
    with pytest.raises(ValueError, match="no CUDA GPU"):
        pick_device("cuda")


@pytest.fixture(scope="module")
def config_only_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("config_only")
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256,
               hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
               bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_dummy_weights_run_from_a_config_alone(config_only_dir, quantization):
    llm = LLM(model=config_only_dir, load_format="dummy", skip_tokenizer_init=True,
              num_kv_blocks=32, quantization=quantization)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    weights = [p for n, p in llm.engine.model.named_parameters() if n.endswith("embed_tokens.weight")]
    assert weights and 0.01 < float(weights[0].float().std()) < 0.03   # N(0, 0.02), not zeros


def test_without_dummy_a_config_alone_is_refused(config_only_dir):
    with pytest.raises(Exception, match="safetensors|weights|model"):
        LLM(model=config_only_dir, skip_tokenizer_init=True, num_kv_blocks=32)
