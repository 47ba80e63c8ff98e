"""``LLM.embed`` end to end on a tiny random Llama saved by transformers: mean and last pooling
equal HF's final normed hidden states; the vectors do not depend on chunking, batching,
prefix caching or preemption; pooling requests mixed with generation leave its greedy tokens
alone."""
import math

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.pooling_params import PoolingParams

PROMPTS = [[(19 * i + 7 * j) % 380 + 3 for j in range(n)] for i, n in enumerate([5, 17, 1, 40, 33, 9])]
MEAN, LAST = PoolingParams(), PoolingParams(pooling_type="last")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=128, block_size=8)


def embed(llm, prompts, params=MEAN):
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(o.finished and o.finish_reason == "stop" for o in outs)
    return [o.outputs.embedding for o in outs]


def hf_reference(hf, prompt, pooling_type, normalize):
    """HF's last hidden_states entry is the output of the final norm: the rows the LM head
    reads, which tokenmill pools."""
    with torch.no_grad():
        hidden = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
    vec = hidden.mean(0) if pooling_type == "mean" else hidden[-1]
    return torch.nn.functional.normalize(vec, dim=0) if normalize else vec


def max_error(a, b) -> float:
    return (torch.tensor(a) - torch.as_tensor(b)).abs().max().item()


@pytest.mark.parametrize("pooling_type", ["mean", "last"])
@pytest.mark.parametrize("normalize", [True, False])
def test_pooled_vectors_match_hf(llm, tiny_llama_hf, pooling_type, normalize):
    params = PoolingParams(pooling_type=pooling_type, normalize=normalize)
    for prompt, vec in zip(PROMPTS, embed(llm, PROMPTS, params)):
        assert len(vec) == 64
        assert max_error(vec, hf_reference(tiny_llama_hf, prompt, pooling_type, normalize)) < 1e-4
        if normalize:
            assert abs(math.fsum(x * x for x in vec) - 1.0) < 1e-5


@pytest.mark.parametrize("params", [MEAN, LAST], ids=["mean", "last"])
def test_chunking_and_batching_do_not_change_vectors(tiny_llama_dir, llm, params):
    alone = [embed(llm, [p], params)[0] for p in PROMPTS]
    assert max(max_error(a, b) for a, b in zip(embed(llm, PROMPTS, params), alone)) < 1e-5
    chunked = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=128,
                  block_size=8, max_num_batched_tokens=7, max_num_seqs=3)
    assert max(max_error(a, b) for a, b in zip(embed(chunked, PROMPTS, params), alone)) < 1e-5


@pytest.mark.parametrize("params", [MEAN, LAST], ids=["mean", "last"])
def test_prefix_caching_keeps_vectors(tiny_llama_dir, params):
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=64, block_size=8,
              enable_prefix_caching=True)
    prompt = PROMPTS[3]   # 40 tokens = 5 full blocks
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    first = llm.embed([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    again = llm.embed([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert again.outputs.embedding == first.outputs.embedding
    # Mean pooling needs every row, so it never takes hits; last pooling may (it only reads
    # the last row, which is always computed).
    assert (again.num_cached_tokens > 0) == (params.pooling_type == "last")


@pytest.mark.parametrize("params", [MEAN, LAST], ids=["mean", "last"])
def test_pooling_mixed_with_generation_and_preemption(tiny_llama_dir, llm, params):
    """Two greedy requests and four pooling ones share a 10-block pool with an 8-token budget:
    pooling requests are chunked, batched with decode steps and preempted, and neither
    kind's results change."""
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    gen_prompts, pool_prompts = [PROMPTS[0], PROMPTS[5]], PROMPTS[1:5]
    want_tokens = [o.outputs[0].token_ids for o in
                   llm.generate([{"prompt_token_ids": p} for p in gen_prompts], greedy,
                                use_tqdm=False)]
    want_vectors = embed(llm, pool_prompts, params)
    small = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=10, block_size=4,
                max_num_batched_tokens=8)
    engine = small.engine
    gen_ids = [engine.add_request(None, {"prompt_token_ids": p}, greedy) for p in gen_prompts]
    pool_ids = [engine.add_request(None, {"prompt_token_ids": p}, params) for p in pool_prompts]
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert small.get_stats()["num_preemptions"] > 0
    assert [finals[i].outputs[0].token_ids for i in gen_ids] == want_tokens
    assert max(max_error(finals[i].outputs.embedding, w)
               for i, w in zip(pool_ids, want_vectors)) < 1e-5
    assert small.get_memory_stats()["num_free_blocks"] == 10
    assert not engine.runner.states


def test_prompt_may_fill_max_model_len(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=16, block_size=8,
              max_model_len=32)
    prompt = [(3 * j) % 380 + 3 for j in range(32)]
    assert len(embed(llm, [prompt])[0]) == 64
    with pytest.raises(ValueError, match="max_model_len"):
        embed(llm, [prompt + [5]])


@pytest.mark.parametrize("prompt,params,match", [
    ({"prompt_token_ids": []}, MEAN, "empty"),
    ({"prompt_token_ids": [1, 384]}, MEAN, "outside the vocabulary"),
    ({"prompt_token_ids": [1, 2]}, PoolingParams(dimensions=32), "dimensions"),
])
def test_bad_requests_raise_and_engine_keeps_working(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.embed([prompt], params, use_tqdm=False)
    assert not llm.engine.scheduler.requests
    assert embed(llm, [PROMPTS[0]], PoolingParams(dimensions=64)) == embed(llm, [PROMPTS[0]])


@pytest.mark.parametrize("kwargs,match", [
    (dict(pooling_type="cls"), "pooling_type"), (dict(normalize=1), "normalize"),
    (dict(dimensions=0), "dimensions"), (dict(dimensions=True), "dimensions"),
])
def test_pooling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PoolingParams(**kwargs)
