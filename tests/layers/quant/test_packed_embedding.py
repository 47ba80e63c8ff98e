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


@pytest.mark.parametrize("quant", ["int8", "int4-g32"])
def test_tied_embedding_reads_rows_from_a_tiled_only_head(tied_dir, quant):
    """q8 activations: the head's tiled copy is its only copy, and the tied embedding reads
    its rows back out of the tiles: the same tokens and logprobs as without tiling."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.layers import native
    if not native.buildable():
        pytest.skip("no C compiler, or a CPU without AVX2: nothing is tiled")
    kw = dict(model=tied_dir, skip_tokenizer_init=True, quantization=quant, quant_activations="q8")
    tiled, plain = LLM(**kw), LLM(**kw, cpu_weight_prepack=False)
    head = tiled.engine.model.lm_head.packed[0]
    assert head.qweight is None and head.tiled is not None
    assert tiled.engine.model.model.embed_tokens.packed is head
    ids = torch.tensor([0, 255, 17, 17, 130])
    assert torch.equal(tiled.engine.model.model.embed_tokens(ids),
                       plain.engine.model.model.embed_tokens(ids))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    prompt = [{"prompt_token_ids": [5, 9, 17, 33]}]
    a = tiled.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    b = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids
