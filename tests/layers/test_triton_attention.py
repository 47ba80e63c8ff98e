"""The Triton attention kernels (KV write, paged attention with GQA, sliding windows, context
splits, int8 / fp8 caches) against the reference backend. Without a GPU they run in Triton's
interpreter on CPU tensors (tests/conftest.py), so the shapes stay small."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.layers.attention import AttentionMetadata, ReferenceAttention  # noqa: E402
from tokenmill.layers.attention import triton_kernels as tk  # noqa: E402
from tokenmill.layers.attention.kv_quant import QuantizedKV, quantize_kv  # noqa: E402
from tokenmill.layers.attention.triton import TritonAttention  # noqa: E402
from tests.layers.block_tables import shuffled_block_tables  # noqa: E402

FP8 = torch.float8_e4m3fn


def _inputs(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size=16,
            num_blocks=24, dtype=torch.float32, seed=0, cache_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    t = sum(query_lens)
    q = torch.randn(t, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(t, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(t, num_kv_heads, head_dim, generator=gen).to(dtype)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Earlier context already in the cache: random values in every slot.
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype or dtype)
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype or dtype)
    tables = shuffled_block_tables(seq_lens, block_size, num_blocks, gen)
    return q, k, v, k_cache, v_cache, tables


def _both(query_lens, seq_lens, device, num_heads=4, num_kv_heads=2, head_dim=32,
          block_size=16, dtype=torch.float32, window=None, num_splits=1, cache_dtype=None):
    """(triton output, reference output), each after writing the step's K/V itself."""
    q, k, v, k_cache, v_cache, tables = _inputs(query_lens, seq_lens, num_heads, num_kv_heads,
                                                head_dim, block_size, dtype=dtype,
                                                cache_dtype=cache_dtype)
    scale = head_dim ** -0.5
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, "cpu")
    ref = ReferenceAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, scale,
                                       window)
    dev = [x.to(device) for x in (q, k, v, k_cache, v_cache)]
    meta_dev = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device)
    tk.write_kv(dev[1], dev[2], dev[3], dev[4], meta_dev.slot_mapping)
    out = tk.paged_attention(dev[0], dev[3], dev[4], meta_dev.query_start_loc,
                             meta_dev.seq_lens, meta_dev.block_tables, meta_dev.max_query_len,
                             scale, window, num_splits=num_splits)
    return out.cpu(), ref


def test_mixed_step_with_gqa_matches_reference(triton_device):
    # a decode token, a whole prefill, a chunk over cached context, a speculative run of 3
    out, ref = _both([1, 5, 6, 3], [37, 5, 40, 20], triton_device)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_odd_group_head_dim_and_block_size(triton_device):
    # 3 query heads per KV head, head_dim 24, blocks of 5 slots: every padded path
    out, ref = _both([2, 1], [13, 9], triton_device, num_heads=6, num_kv_heads=2, head_dim=24,
                     block_size=5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_sliding_window(triton_device):
    out, ref = _both([4, 1], [30, 26], triton_device, window=7)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_splits", [2, 8])
def test_context_splits_merge_to_the_same_answer(triton_device, num_splits):
    # 8 splits of a 3-token context leave most splits empty; they must weigh nothing
    out, ref = _both([1, 1, 2], [150, 3, 70], triton_device, num_splits=num_splits,
                     window=None)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_bf16(triton_device):
    out, ref = _both([1, 4], [40, 9], triton_device, dtype=torch.bfloat16)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_half_precision_cache_under_a_float32_model(triton_device):
    """kv_cache_dtype bf16 with fp32 weights: K/V rounded on write, widened on read."""
    out, ref = _both([1, 3], [33, 12], triton_device, cache_dtype=torch.bfloat16)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_padding_rows_write_nothing_and_return_zeros(triton_device):
    """A CUDA-graph bucket's padding: slot -1 and context 0."""
    q, k, v, k_cache, v_cache, tables = _inputs([1], [10], 4, 2, 32)
    meta = AttentionMetadata.build([1], [10], tables, 16, "cpu")
    ref = ReferenceAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), meta,
                                       0.2)
    pad = lambda x: torch.cat([x, torch.randn_like(x)]).to(triton_device)  # noqa: E731
    k_dev, v_dev = k_cache.to(triton_device), v_cache.to(triton_device)
    before = k_dev.clone()
    slots = torch.tensor([int(meta.slot_mapping[0]), -1], device=triton_device)
    tk.write_kv(pad(k), pad(v), k_dev, v_dev, slots)
    changed = (k_dev != before).any(dim=-1).any(dim=-1).flatten().nonzero().flatten()
    assert changed.tolist() == [int(meta.slot_mapping[0])]
    tables_dev = torch.zeros(2, 1, dtype=torch.int64, device=triton_device)
    tables_dev[0, 0] = tables[0][0]
    out = tk.paged_attention(pad(q), k_dev, v_dev,
                             torch.arange(3, device=triton_device),
                             torch.tensor([10, 0], device=triton_device), tables_dev, 1, 0.2,
                             num_splits=2)
    torch.testing.assert_close(out[0].cpu(), ref[0], rtol=1e-5, atol=1e-5)
    assert bool((out[1] == 0).all())


@pytest.mark.parametrize("dtype", [torch.int8, FP8])
def test_quantized_write_is_bit_identical_to_quantize_kv(triton_device, dtype):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 2, 24, generator=gen) * 10.0 ** torch.randint(-2, 2, (6, 2, 1))
    x[0, 0] = 0.0                       # an all-zero row
    x[1, 1, :3] = torch.tensor([0.5, -1.5, 2.5]) * (x[1, 1].abs().max() / 127 * 2)  # ties
    values, scale = quantize_kv(x, dtype)
    cache = QuantizedKV.zeros((4, 4, 2, 24), dtype, triton_device)
    other = QuantizedKV.zeros((4, 4, 2, 24), dtype, triton_device)
    slots = torch.tensor([5, 0, 15, 7, 8, 2], device=triton_device)
    tk.write_kv(x.to(triton_device), x.to(triton_device), cache.values, other.values, slots,
                cache.scale, other.scale)
    got = cache.values.view(torch.int8).flatten(0, 1)[slots.cpu()].cpu()
    assert torch.equal(got, values.view(torch.int8))
    assert torch.equal(cache.scale.flatten(0, 1)[slots.cpu()].cpu(), scale)


@pytest.mark.parametrize("dtype", [torch.int8, FP8])
def test_attention_over_quantized_cache(triton_device, dtype):
    query_lens, seq_lens = [1, 4], [30, 12]
    q, k, v, k_f, v_f, tables = _inputs(query_lens, seq_lens, 4, 2, 32)
    shape = k_f.shape
    caches = []
    for device in ("cpu", triton_device):
        kc, vc = QuantizedKV.zeros(shape, dtype, device), QuantizedKV.zeros(shape, dtype, device)
        every_slot = torch.arange(shape[0] * shape[1], device=device)
        kc.write(k_f.flatten(0, 1).to(device), every_slot)
        vc.write(v_f.flatten(0, 1).to(device), every_slot)
        caches.append((kc, vc))
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, 16, "cpu")
    ref = ReferenceAttention().forward(q, k, v, *caches[0], meta, 0.2)
    backend = TritonAttention(torch.device(triton_device), num_kv_heads=2)
    meta_dev = backend.build_metadata(query_lens, seq_lens, tables, 16, triton_device)
    out = backend.forward(q.to(triton_device), k.to(triton_device), v.to(triton_device),
                          *caches[1], meta_dev, 0.2)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)


def test_choose_num_splits():
    assert tk.choose_num_splits(256, 8, 4096, 132) == 1        # the batch fills the GPU
    assert tk.choose_num_splits(1, 8, 100, 132) == 1           # too short to split
    assert tk.choose_num_splits(1, 8, 4096, 132) == 16         # 8 heads x 16 splits ~ 132 SMs
    assert tk.choose_num_splits(1, 1, 1 << 20, 132) == tk.MAX_SPLITS
    for args in [(3, 2, 5000, 132), (1, 4, 777, 80)]:
        n = tk.choose_num_splits(*args)
        assert n >= 1 and n & (n - 1) == 0


def test_bad_inputs_are_refused(triton_device):
    q, k, v, k_cache, v_cache, tables = _inputs([1], [4], 4, 2, 32)
    k_cache, v_cache = k_cache.to(triton_device), v_cache.to(triton_device)
    with pytest.raises(ValueError, match="scales"):
        tk.write_kv(k.to(triton_device), v.to(triton_device), k_cache, v_cache,
                    torch.zeros(1, dtype=torch.int64, device=triton_device),
                    k_scale=torch.zeros(1, device=triton_device),
                    v_scale=torch.zeros(1, device=triton_device))
    with pytest.raises(ValueError, match="contiguous"):
        tk.write_kv(k, v, k_cache.transpose(0, 1), v_cache.transpose(0, 1),
                    torch.zeros(1, dtype=torch.int64))


def test_fp8_write_rounds_every_midpoint_to_even(triton_device):
    """Values halfway between neighbouring E4M3 values (normal and subnormal), scaled so the
    row's amax maps to 448: the write must round each as torch does (to the even one)."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()    # 0 .. 448, ascending
    mids = (grid[:-1] + grid[1:]) / 2
    row = torch.cat([grid[-1:], mids[-127:], -mids[:1]])[:128]
    x = row.view(1, 1, 128)
    values, scale = quantize_kv(x, FP8)
    cache = QuantizedKV.zeros((1, 2, 1, 128), FP8, triton_device)
    other = QuantizedKV.zeros((1, 2, 1, 128), FP8, triton_device)
    slot = torch.zeros(1, dtype=torch.int64, device=triton_device)
    tk.write_kv(x.to(triton_device), x.to(triton_device), cache.values, other.values, slot,
                cache.scale, other.scale)
    assert torch.equal(cache.values[0, 0].cpu().view(torch.int8), values[0].view(torch.int8))


def test_backend_splits_only_decode_like_steps(triton_device):
    backend = TritonAttention(torch.device(triton_device), num_kv_heads=8)
    table = [list(range(256))]
    decode = backend.build_metadata([1], [4096], table, 16, triton_device)
    prefill = backend.build_metadata([512], [4096], table, 16, triton_device)
    assert decode.num_splits == tk.choose_num_splits(1, 8, 4096, backend.num_sms) > 1
    assert prefill.num_splits == 1
