"""The CUDA backend's code path end to end on a tiny random Llama: Triton attention, norms,
RoPE and activations (in Triton's interpreter where there is no GPU), the decode-graph
buffers with their padding rows, against HF transformers and the reference backend."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.runner.cuda_graphs import DecodeGraphs, capture_sizes  # noqa: E402

PROMPTS = [[(13 * i + 7 * j) % 380 + 3 for j in range(n)] for i, n in enumerate([5, 19, 2, 33])]


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def _run(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def triton_llm(tiny_llama_dir, triton_device):
    # small chunks: prefills run as chunks over cached context (the mixed-step kernel)
    return LLM(model=tiny_llama_dir, skip_tokenizer_init=True, device=triton_device.type,
               attention_backend="triton", num_kv_blocks=64, block_size=16,
               max_num_batched_tokens=24, enable_prefix_caching=True)


def test_greedy_matches_hf(triton_llm, tiny_llama_hf):
    runner = triton_llm.engine.runner
    assert runner.backend.name == "triton"
    assert triton_llm.engine.runner.model.model.norm.triton_kernels
    outs = _run(triton_llm, PROMPTS, _greedy(8))
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == _hf_greedy(tiny_llama_hf, prompt, 8)


def test_prefix_hit_gives_the_same_tokens(triton_llm):
    prompt = PROMPTS[3] + [5, 6, 7]
    first = _run(triton_llm, [prompt], _greedy(6))[0]
    again = _run(triton_llm, [prompt], _greedy(6))[0]
    assert again.num_cached_tokens >= 16
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_kv_matches_the_reference_backend(tiny_llama_dir, triton_device,
                                                   kv_cache_dtype):
    kw = dict(model=tiny_llama_dir, skip_tokenizer_init=True, device=triton_device.type,
              num_kv_blocks=32, block_size=16, kv_cache_dtype=kv_cache_dtype)
    params = _greedy(5, logprobs=1)
    got = _run(LLM(attention_backend="triton", **kw), PROMPTS[:2], params)
    want = _run(LLM(attention_backend="reference", **kw), PROMPTS[:2], params)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for g_lp, w_lp, tok in zip(g.outputs[0].logprobs, w.outputs[0].logprobs,
                                   g.outputs[0].token_ids):
            assert abs(g_lp[tok].logprob - w_lp[tok].logprob) < 1e-4


def test_decode_graph_buffers_pad_a_bucket(triton_llm, tiny_llama_hf):
    """Three requests decode in the bucket of 4 (one padding row: slot -1, context 0),
    run eagerly on the persistent buffers: the tokens stay HF's."""
    runner = triton_llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.backend, max_num_seqs=4,
                          max_model_len=128, block_size=16, device=runner.device,
                          capture=False)
    used = []
    run = graphs.run

    def spy(inp, size):
        used.append((len(inp.attn_meta.query_lens), size))
        return run(inp, size)

    graphs.run = spy
    runner.graphs = graphs
    try:
        outs = _run(triton_llm, PROMPTS[:3], _greedy(4))
    finally:
        runner.graphs = None
    assert (3, 4) in used
    for prompt, out in zip(PROMPTS[:3], outs):
        assert out.outputs[0].token_ids == _hf_greedy(tiny_llama_hf, prompt, 4)


def test_window_pools_run_on_the_graph_buffers(tmp_path, triton_device):
    """A tiny Gemma3 (window 8) whose sliding layers keep their window in a pool of their
    own: decode steps run on the bucket buffers, a table and slot buffer per KV group, and
    give the reference backend's tokens."""
    from tests.models.test_fused_architectures import _save_tiny
    _, path = _save_tiny("gemma3", tmp_path)
    prompts = [[(13 * i + 7 * j) % 250 + 3 for j in range(n)] for i, n in enumerate([5, 19, 2, 33])]
    kw = dict(model=path, skip_tokenizer_init=True, num_kv_blocks=64, block_size=4, max_num_seqs=4,
              max_num_batched_tokens=16)
    llm = LLM(attention_backend="triton", device=triton_device.type, **kw)
    runner = llm.engine.runner
    assert [g.window for g in runner.kv_layout.groups] == [None, 8]
    graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.backend, max_num_seqs=4,
                          max_model_len=256, block_size=4, device=runner.device, capture=False,
                          kv_layout=runner.kv_layout)
    used = []
    run = graphs.run

    def spy(inp, size):
        used.append(size)
        return run(inp, size)

    graphs.run = spy
    runner.graphs = graphs
    got = _run(llm, prompts, _greedy(10))
    want = _run(LLM(attention_backend="reference", **kw), prompts, _greedy(10))
    assert used and [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_capture_sizes():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(40) == (1, 2, 4, 8, 16, 32, 40)
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 32, 48, 64)


def test_triton_backend_refused_on_cpu_without_the_interpreter(monkeypatch):
    import triton

    from tokenmill.layers.attention.triton import TritonAttention
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        TritonAttention(torch.device("cpu"))
