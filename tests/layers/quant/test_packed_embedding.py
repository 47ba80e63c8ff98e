"""A tied embedding reads its rows from the packed head: same rows, no float copy kept."""
import pytest
import torch

from tests.conftest import save_tiny_llama
from tokenmill.layers.quant.embedding import PackedEmbedding
from tokenmill.layers.quant.formats import dequantize, quantize_int8


def test_rows_equal_dequantized_head():
    w = torch.randn(50, 64, generator=torch.Generator().manual_seed(0))
    p = quantize_int8(w)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    got = PackedEmbedding(p)(ids)
    assert got.shape == (2, 3, 64)
    assert torch.equal(got, dequantize(p)[ids])


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_tied")
    save_tiny_llama(path, tie_word_embeddings=True, vocab_size=256)
    return str(path)


@pytest.mark.parametrize("quant", ["int8", "int4-g32"])
def test_quantized_tied_model_drops_float_embedding(tied_dir, quant):
    from tokenmill import LLM, SamplingParams
    plain = LLM(model=tied_dir, skip_tokenizer_init=True)
    llm = LLM(model=tied_dir, skip_tokenizer_init=True, quantization=quant)
    assert isinstance(llm.engine.model.model.embed_tokens, PackedEmbedding)
    head_bytes = 256 * 64 * 4
    assert llm.engine.weight_bytes < plain.engine.weight_bytes - head_bytes   # fp32 copy gone
    out = llm.generate([{"prompt_token_ids": [5, 9, 17, 33]}],
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6
