"""Quantized KV cache (int8, fp8 E4M3, one scale per slot per KV head): round-trip error
bounds, the fp8 bit-trick decode, cache writes, and attention over a quantized cache against
(a) the reference backend over the dequantized values (tight: same numbers, same math) and
(b) the float32 cache (loose: the quantization error itself)."""
from __future__ import annotations

import math
import os
import random

import pytest
import torch

from tokenmill.layers.attention import AttentionMetadata, CpuAttention, ReferenceAttention
from tokenmill.layers.attention.kv_quant import (QuantizedKV, _fp8_to_float_over_256,
                                                 dequantize_kv, quantize_kv, slot_bytes)
from tokenmill.runner.kv_tensors import allocate_kv_caches, bytes_per_block, kv_storage_dtype

FP8 = torch.float8_e4m3fn
QDTYPES = [torch.int8, FP8]


def _random_kv(num_tokens, num_kv_heads, head_dim, seed=0):
    """Rows with magnitudes spread over four decades, plus one all-zero row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    x *= 10.0 ** torch.randint(-2, 2, (num_tokens, num_kv_heads, 1), generator=gen)
    x[0, 0] = 0.0
    return x


# ---------------------------------------------------------------- quantize / dequantize

@pytest.mark.parametrize("shape", [(7, 2, 64), (33, 4, 16), (1, 1, 128)])
def test_int8_round_trip_within_half_step(shape):
    x = _random_kv(*shape)
    q, scale = quantize_kv(x, torch.int8)
    assert q.dtype == torch.int8 and scale.shape == shape[:2] and scale.dtype == torch.float32
    err = (dequantize_kv(q, scale) - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    # Round to nearest: at most half a step (amax / 127 / 2) per element.
    assert bool((err <= amax / 254 * (1 + 1e-5) + 1e-30).all())
    assert q.abs().max() <= 127


@pytest.mark.parametrize("shape", [(7, 2, 64), (33, 4, 16)])
def test_fp8_round_trip_relative_error(shape):
    x = _random_kv(*shape, seed=1)
    q, scale = quantize_kv(x, FP8)
    assert q.dtype == FP8
    err = (dequantize_kv(q, scale) - x).abs()
    # 3 mantissa bits: half an ulp is <= 2**-4 of the value; below the smallest normal the
    # step is fixed (2**-9 of the scale).
    bound = x.abs() * 2.0**-4 + scale[..., None] * 2.0**-10
    assert bool((err <= bound * (1 + 1e-5) + 1e-30).all())
    assert bool((q.float().abs().amax(-1) <= 448).all())


@pytest.mark.parametrize("dtype", QDTYPES)
def test_all_zero_rows_stay_zero(dtype):
    x = torch.zeros(3, 2, 8)
    q, scale = quantize_kv(x, dtype)
    out = dequantize_kv(q, scale)
    assert torch.equal(out, x) and bool(torch.isfinite(scale).all())


def test_fp8_bit_decode_is_exact_for_every_finite_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]               # drop the two NaN codes
    values = codes.view(FP8)
    assert torch.equal(_fp8_to_float_over_256(values) * 256.0, values.float())


# ---------------------------------------------------------------- cache object

@pytest.mark.parametrize("dtype", QDTYPES)
def test_write_then_read_blocks(dtype):
    cache = QuantizedKV.zeros((6, 4, 2, 16), dtype, "cpu")
    x = _random_kv(5, 2, 16, seed=2)
    slots = torch.tensor([9, 0, 23, 4, 10])
    cache.write(x, slots)
    q, scale = quantize_kv(x, dtype)
    expected = torch.zeros(24, 2, 16)
    expected[slots] = dequantize_kv(q, scale)
    got = cache.index_select(0, torch.arange(6)).flatten(0, 1)
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert torch.equal(cache.read_slots(slots), dequantize_kv(q, scale))
    # Reading a subset of blocks in any order returns those blocks.
    assert torch.equal(cache.index_select(0, torch.tensor([5, 2])),
                       expected.view(6, 4, 2, 16)[[5, 2]])


def test_sizes_and_allocation():
    # int8: 64 one-byte values + a 4-byte scale per head, vs 64 * 4 bytes in float32.
    assert slot_bytes(3, 64, torch.int8) == 3 * 68
    assert slot_bytes(3, 64, torch.float32) == 3 * 256
    fp32 = bytes_per_block(30, 16, 3, 64, torch.float32)
    int8 = bytes_per_block(30, 16, 3, 64, torch.int8)
    assert fp32 / int8 == pytest.approx(256 / 68)
    assert kv_storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_storage_dtype("fp8", torch.float32) == FP8
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_storage_dtype("fp8_e5m2", torch.float32)
    caches = allocate_kv_caches(2, 5, 4, 3, 8, torch.int8, torch.device("cpu"))
    k, v = caches[0]
    assert isinstance(k, QuantizedKV) and k.shape == (5, 4, 3, 8) and k.scale.shape == (5, 4, 3)
    plain = allocate_kv_caches(1, 5, 4, 3, 8, torch.float32, torch.device("cpu"))
    assert isinstance(plain[0][0], torch.Tensor)


# ---------------------------------------------------------------- attention

def _scenario(runs, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    """fp32 caches of random garbage holding each request's earlier context in scrambled
    blocks, plus this step's query / key / value. runs: (query_len, seq_len) per request."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    needed = [math.ceil(s / block_size) for _, s in runs]
    num_blocks = sum(needed) + 2
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in needed]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    meta = AttentionMetadata.build([q for q, _ in runs], [s for _, s in runs], tables,
                                   block_size, "cpu")
    t = meta.num_tokens
    query = torch.randn(t, num_heads, head_dim, generator=gen)
    key = torch.randn(t, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(t, num_kv_heads, head_dim, generator=gen)
    return query, key, value, k_cache, v_cache, meta


def _quantized(cache: torch.Tensor, dtype) -> QuantizedKV:
    q, scale = quantize_kv(cache.flatten(0, 1), dtype)
    return QuantizedKV(q.view(cache.shape).contiguous(), scale.view(cache.shape[:-1]).contiguous())


def _round_trip(x: torch.Tensor, dtype) -> torch.Tensor:
    return dequantize_kv(*quantize_kv(x, dtype))


def _meta(meta):   # a fresh metadata object: plan_cache is per step
    return AttentionMetadata.build(meta.query_lens, meta.seq_lens_list,
                                   [row.tolist() for row in meta.block_tables],
                                   meta.block_size, "cpu")


CASES = {
    # name: (runs, num_heads, num_kv_heads, head_dim, block_size, sliding_window)
    "decode": ([(1, 5), (1, 37), (1, 16), (1, 64)], 4, 4, 32, 16, None),
    "decode_gqa": ([(1, 9), (1, 50), (1, 33)], 8, 2, 16, 8, None),
    "spec": ([(3, 20), (1, 7), (5, 41)], 6, 2, 32, 16, None),
    "chunked_prefill": ([(24, 40), (17, 80), (1, 12)], 4, 2, 32, 16, None),
    "sliding_window": ([(1, 45), (20, 60), (3, 30)], 4, 1, 32, 8, 12),
    "first_chunk": ([(30, 30), (1, 19)], 4, 2, 32, 16, None),
    # one long row: its keys split over the threads, each run read as whole slot rows
    "one_long": ([(1, 300)], 6, 2, 64, 16, None),
}

# Max |quantized - fp32| of the attention output on unit-variance random K/V (outputs up to
# ~3); measured <= 0.013 (int8) and <= 0.08 (fp8) over these cases (fixed seed).
TOL_VS_FP32 = {torch.int8: 0.03, FP8: 0.15}


@pytest.mark.parametrize("dtype", QDTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("case", list(CASES))
def test_attention_over_quantized_cache(case, dtype):
    runs, num_heads, num_kv_heads, head_dim, block_size, window = CASES[case]
    query, key, value, k_cache, v_cache, meta = _scenario(runs, num_heads, num_kv_heads,
                                                          head_dim, block_size)
    scale = head_dim ** -0.5
    qk, qv = _quantized(k_cache, dtype), _quantized(v_cache, dtype)
    # Oracle: the reference backend on float32 caches holding exactly the dequantized
    # values, fed this step's K/V after the same round trip.
    dk, dv = qk.index_select(0, torch.arange(k_cache.shape[0])), qv.index_select(
        0, torch.arange(v_cache.shape[0]))
    oracle = ReferenceAttention().forward(query, _round_trip(key, dtype), _round_trip(value, dtype),
                                          dk.clone(), dv.clone(), _meta(meta), scale, window)
    fp32 = CpuAttention().forward(query, key, value, k_cache.clone(), v_cache.clone(),
                                  _meta(meta), scale, window)
    for backend in (CpuAttention(), ReferenceAttention()):
        qk, qv = _quantized(k_cache, dtype), _quantized(v_cache, dtype)
        out = backend.forward(query, key, value, qk, qv, _meta(meta), scale, window)
        assert out.dtype == query.dtype and bool(torch.isfinite(out).all())
        # The step's own tokens were written, quantized.
        assert torch.equal(qk.read_slots(meta.slot_mapping), _round_trip(key, dtype))
        assert torch.equal(qv.read_slots(meta.slot_mapping), _round_trip(value, dtype))
        if case == "first_chunk" and backend.name == "cpu":
            # A chunk at position 0 attends to its fresh float32 K/V (no cache read).
            assert torch.allclose(out[:30], fp32[:30], atol=1e-6)
            assert torch.allclose(out[30:], oracle[30:], atol=1e-5)
        else:
            assert torch.allclose(out, oracle, atol=1e-5), (out - oracle).abs().max()
        assert (out - fp32).abs().max() < TOL_VS_FP32[dtype]


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's VmRSS")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8,
                                   torch.float8_e4m3fn])
def test_cpu_cache_pool_is_zero_and_resident_only_where_written(dtype):
    """A pool of 64-256 MB adds almost nothing to RSS until written; it reads as zeros, takes
    writes, and its pages come and go with the tensors."""
    before = _rss_mb()
    caches = allocate_kv_caches(2, 256, 16, 8, 512, dtype, torch.device("cpu"))   # 64-256 MB
    assert _rss_mb() - before < 16
    k = caches[0][0].values if isinstance(caches[0][0], QuantizedKV) else caches[0][0]
    assert k.shape == (256, 16, 8, 512) and k.dtype == dtype and k.is_contiguous()
    assert not k[::97].float().any()                      # zeros, as torch.zeros
    k[3].fill_(1)                                         # writes land (one block resident)
    assert k[3].float().eq(1).all() and not k[2].float().any()
    del caches, k
