"""The C prefill attention (cpu_prefill.c): causal (and windowed) attention of prefill chunks
from the paged cache, against a float64 reference, with every row's bits fixed by the row
alone: the same in any chunking of the prompt, beside any other requests, and in both
builds."""
import pytest
import torch

from tokenmill.layers import cpu_ops, native
from tokenmill.layers.attention.metadata import AttentionMetadata

pytestmark = pytest.mark.skipif(not native.buildable(), reason="no C compiler, or a CPU without AVX2")

BS = 16


def _cache(hkv, d, dtype, g, nblocks=80):
    k = torch.randn(nblocks, BS, hkv, d, generator=g).to(dtype)
    v = torch.randn(nblocks, BS, hkv, d, generator=g).to(dtype)
    return k, v, torch.randperm(nblocks, generator=g).tolist()


def _tables(seq_lens, perm):
    tables, used = [], 0
    for n in seq_lens:
        tables.append(perm[used:used + -(-n // BS)])
        used += len(tables[-1])
    return tables


def _run(q, k, v, q_lens, seq_lens, tables, window, bf16_math=False):
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, BS, "cpu")
    out = torch.full_like(q, float("nan"))
    assert cpu_ops.prefill_attention(q, k, v, meta.block_tables, meta.query_start_loc[:-1],
                                     torch.tensor(q_lens), meta.seq_lens, 0.125, window, out,
                                     bf16_math=bf16_math)
    return out


def _reference(q, k, v, table, seq_len, window):
    hq, hkv = q.shape[1], k.shape[2]
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(seq_len)])
    kk = k.reshape(-1, hkv, k.shape[3])[slots].double().repeat_interleave(hq // hkv, 1)
    vv = v.reshape(-1, hkv, v.shape[3])[slots].double().repeat_interleave(hq // hkv, 1)
    pos, keys = torch.arange(seq_len - q.shape[0], seq_len), torch.arange(seq_len)
    seen = keys[None] <= pos[:, None]
    if window:
        seen &= keys[None] > pos[:, None] - window
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * 0.125
    p = s.masked_fill(~seen[None], float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", p, vv).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 32), (8, 1, 48)])
@pytest.mark.parametrize("window", [None, 37])
def test_prefill_attention_matches_the_reference(dtype, hq, hkv, d, window):
    """Requests of 9 to 130 query rows (whole prompts and chunks after a cached context;
    tiles of 16 rows, partial ones, GQA groups of 1 to 8 heads), several in one call."""
    g = torch.Generator().manual_seed(hq * d)
    k, v, perm = _cache(hkv, d, dtype, g)
    q_lens, seq_lens = [50, 9, 130, 17, 40], [50, 100, 300, 17, 500]
    tables = _tables(seq_lens, perm)
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    out = _run(q, k, v, q_lens, seq_lens, tables, window)
    start = 0
    for ql, sl, t in zip(q_lens, seq_lens, tables):
        torch.testing.assert_close(out[start:start + ql], _reference(q[start:start + ql], k, v, t, sl, window),
                                   rtol=1e-5, atol=2e-5)
        start += ql


@pytest.mark.parametrize("window", [None, 37])
def test_prefill_rows_do_not_depend_on_the_chunk_or_the_batch(window):
    """A prompt's rows prefilled in one call equal them prefilled in chunks of 1, 7 or 40
    rows (the prefix already cached), and beside other requests."""
    g = torch.Generator().manual_seed(7)
    k, v, perm = _cache(3, 64, torch.float32, g)
    seq_len, n = 300, 130
    table = _tables([seq_len, 60], perm)
    q = torch.randn(n, 9, 64, generator=g)
    whole = _run(q, k, v, [n], [seq_len], table[:1], window)
    other = torch.randn(60, 9, 64, generator=g)
    beside = _run(torch.cat([other, q]), k, v, [60, n], [60, seq_len], table[::-1], window)
    assert torch.equal(beside[60:], whole)
    for chunk in (1, 7, 40):
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            part = _run(q[c0:c1].contiguous(), k, v, [c1 - c0], [seq_len - n + c1], table[:1], window)
            assert torch.equal(part, whole[c0:c1]), (chunk, c0)


@pytest.mark.skipif(not (native.has_vnni() and native.buildable()), reason="one build only here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_both_builds_are_bit_identical(dtype, both_builds, monkeypatch):
    """16-lane and 8-lane vectors hold the same per-pair scores and per-value outputs."""
    g = torch.Generator().manual_seed(11)
    k, v, perm = _cache(3, 64, dtype, g)
    q_lens, seq_lens = [50, 130], [90, 300]
    tables = _tables(seq_lens, perm)
    q = torch.randn(sum(q_lens), 9, 64, generator=g)
    outs = []
    for lib in both_builds:
        monkeypatch.setattr(native, "library", lambda lib=lib: lib)
        outs.append(_run(q, k, v, q_lens, seq_lens, tables, 37))
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_prefill_attention_declines_int8_caches():
    from tokenmill.layers.attention.kv_quant import QuantizedKV
    k = QuantizedKV(torch.zeros(4, BS, 1, 32, dtype=torch.int8), torch.ones(4, BS, 1))
    meta = AttentionMetadata.build([9], [9], [[0]], BS, "cpu")
    q = torch.randn(9, 1, 32)
    assert not cpu_ops.prefill_attention(q, k, k, meta.block_tables, meta.query_start_loc[:-1],
                                         torch.tensor([9]), meta.seq_lens, 0.125, None, torch.empty_like(q))


@pytest.mark.parametrize("cached", [288, 300])
def test_a_chunk_after_cached_rows_has_the_bits_of_a_cold_prefill(cached):
    """The CPU backend (layers/attention/cpu.py) over a 600-token prompt in one call, and
    over its last rows once the first are cached: a prefix-cache hit (whole blocks) or a
    chunked prefill whose budget a decode step shared (any row). The rows are identical
    (SDPA's query tiles gave 12 of them other last bits after 300 rows)."""
    from tokenmill.layers.attention.cpu import CpuAttention
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, n = 4, 2, 64, 600
    table = [list(range(-(-n // BS)))]
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (hq, hkv, hkv))

    def prefill(first):
        caches = [torch.zeros(len(table[0]), BS, hkv, d) for _ in range(2)]
        backend, out = CpuAttention(), None
        for lo, hi in ((0, first), (first, n)) if first else ((0, n),):
            meta = AttentionMetadata.build([hi - lo], [hi], table, BS, "cpu")
            out = backend.forward(q[lo:hi], k[lo:hi], v[lo:hi], *caches, meta, 0.125)
        return out
    assert torch.equal(prefill(cached), prefill(0)[cached:])


@pytest.mark.parametrize("quantization,activations", [(None, "fp32"), ("int8", "q8")])
def test_the_last_prompt_rows_after_a_prefix_hit_have_the_bits_of_a_cold_prefill(
        tiny_llama_dir, quantization, activations):
    """A prefix-cache hit that leaves 1-8 prompt rows (a run as short as a decode step's)
    computes them as the prompt's other rows are, not on the decode path: the first token's
    logprobs are the cold prefill's, bit for bit (on q8 activations the decode path's other
    bits flipped greedy tokens of SmolLM2). The C kernels' promise: the plain-PyTorch path
    (cpu_kernels=False) attends with SDPA, whose rows depend on the query tile."""
    from tokenmill import LLM, SamplingParams
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, block_size=4, num_kv_blocks=128,
              quantization=quantization, quant_activations=activations)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=5)
    base = [(7 * j + 3) % 300 + 3 for j in range(40)]

    def run(ids, salt):
        out = llm.generate([{"prompt_token_ids": ids, "cache_salt": salt}], params, use_tqdm=False)[0]
        return out.num_cached_tokens, [{t: lp.logprob for t, lp in step.items()}
                                       for step in out.outputs[0].logprobs]
    for rows in range(1, 9):
        prompt = base[:32 + rows]
        cold = run(prompt, f"cold-{rows}")
        run(prompt[:33], f"hit-{rows}")              # caches the first 32 tokens
        cached, got = run(prompt, f"hit-{rows}")
        assert cached == 32 and got == cold[1], rows


# -- bf16 mode on AMX tiles (cpu_prefill_amx.c) ------------------------------------------------

needs_amx = pytest.mark.skipif(native.bf16_kernel() != "amx", reason="bf16 matmuls not on AMX here")


@needs_amx
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 32), (8, 1, 64), (4, 1, 256)])
@pytest.mark.parametrize("window", [None, 37])
def test_bf16_prefill_attention_is_the_reference_to_bf16_precision(hq, hkv, d, window):
    """bf16 math on a bf16 cache (q and the softmax weights rounded to bf16, float32 sums on
    the tiles): within bf16 precision of the float64 reference, and not the float32
    kernel's numbers (the tiles really ran). Requests of 9 to 130 rows, several a call."""
    g = torch.Generator().manual_seed(hq * d + 1)
    k, v, perm = _cache(hkv, d, torch.bfloat16, g)
    q_lens, seq_lens = [50, 9, 130, 17, 40], [50, 100, 300, 17, 500]
    tables = _tables(seq_lens, perm)
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    out = _run(q, k, v, q_lens, seq_lens, tables, window, bf16_math=True)
    start = 0
    for ql, sl, t in zip(q_lens, seq_lens, tables):
        torch.testing.assert_close(out[start:start + ql], _reference(q[start:start + ql], k, v, t, sl, window),
                                   rtol=2e-2, atol=2e-2)
        start += ql
    assert not torch.equal(out, _run(q, k, v, q_lens, seq_lens, tables, window))


@needs_amx
@pytest.mark.parametrize("window", [None, 37])
def test_bf16_prefill_rows_do_not_depend_on_the_chunk_or_the_batch(window):
    """As the float32 kernel's rows: a prompt prefilled at once, in chunks of 1, 7 or 40 rows
    after its cached prefix, or beside another request, gets the same bits."""
    g = torch.Generator().manual_seed(8)
    k, v, perm = _cache(3, 64, torch.bfloat16, g)
    seq_len, n = 300, 130
    table = _tables([seq_len, 60], perm)
    q = torch.randn(n, 9, 64, generator=g)
    whole = _run(q, k, v, [n], [seq_len], table[:1], window, bf16_math=True)
    other = torch.randn(60, 9, 64, generator=g)
    beside = _run(torch.cat([other, q]), k, v, [60, n], [60, seq_len], table[::-1], window,
                  bf16_math=True)
    assert torch.equal(beside[60:], whole)
    for chunk in (1, 7, 40):
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            part = _run(q[c0:c1].contiguous(), k, v, [c1 - c0], [seq_len - n + c1], table[:1],
                        window, bf16_math=True)
            assert torch.equal(part, whole[c0:c1]), (chunk, c0)


@pytest.mark.parametrize("dtype,d", [(torch.float32, 64), (torch.bfloat16, 48)])
def test_bf16_math_takes_the_float32_kernel_where_the_tiles_do_not_apply(dtype, d):
    """A float32 cache, or a head size that is not a multiple of 32 (or no AMX): the float32
    kernel's bits, whatever bf16_math asks."""
    g = torch.Generator().manual_seed(9)
    k, v, perm = _cache(2, d, dtype, g)
    q = torch.randn(40, 4, d, generator=g)
    table = _tables([70], perm)
    assert torch.equal(_run(q, k, v, [40], [70], table, None, bf16_math=True),
                       _run(q, k, v, [40], [70], table, None))


@needs_amx
def test_bf16_mode_prompts_have_the_same_bits_chunked_cached_or_cold(tmp_path, monkeypatch):
    """End to end (bf16 mode, bf16 K/V, head size 64, so prompts take the tile kernel): a
    prompt prefilled cold, in 24-token chunks, or after a prefix-cache hit gives the same
    tokens and logprobs; with the float32 prefill kernel instead, other numbers."""
    from tests.conftest import save_tiny_llama
    from tokenmill import LLM, SamplingParams
    save_tiny_llama(tmp_path, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    prefix = [(7 * i) % 300 + 3 for i in range(70)]
    prompt = {"prompt_token_ids": prefix + [11, 5, 42, 17, 9]}
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, prompt_logprobs=1, ignore_eos=True)

    def run(**kw):
        llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, cpu_gemm_dtype="bfloat16",
                  kv_cache_dtype="bf16", num_kv_blocks=64, **kw)
        if kw.get("enable_prefix_caching"):
            llm.generate([{"prompt_token_ids": prefix}], params, use_tqdm=False)
        o = llm.generate([prompt], params, use_tqdm=False)[0]
        return (o.outputs[0].token_ids, [{t: p.logprob for t, p in s.items()} for s in o.outputs[0].logprobs],
                [None if s is None else {t: p.logprob for t, p in s.items()} for s in o.prompt_logprobs])

    cold = run(enable_prefix_caching=False)
    assert run(enable_prefix_caching=False, max_num_batched_tokens=24) == cold
    cached = run(enable_prefix_caching=True)
    assert cached[:2] == cold[:2]
    # the rows after the cached blocks are the ones computed again: their logprobs match too
    assert cached[2][-5:] == cold[2][-5:]
    monkeypatch.setattr(native, "bf16_kernel", lambda: "avx512")   # prefill on the float32 kernel
    assert run(enable_prefix_caching=False)[2] != cold[2]
