"""Paged attention: metadata, cache write, reference vs dense, CPU path vs reference."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch

from tokenmill.layers.attention import (
    AttentionMetadata,
    CpuAttention,
    ReferenceAttention,
    get_attention_backend,
    write_kv,
)


# ---------------------------------------------------------------- scenario builder

@dataclass
class Scenario:
    query: torch.Tensor      # [T, H, D]
    key: torch.Tensor        # [T, Hkv, D]
    value: torch.Tensor      # [T, Hkv, D]
    k_cache: torch.Tensor    # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    dense_k: list            # per request [seq_len, Hkv, D], the full unpaged K
    dense_v: list


def make_scenario(runs, *, num_heads, num_kv_heads, head_dim, block_size, seed=0,
                  dtype=torch.float32) -> Scenario:
    """runs: (query_len, seq_len) per request. Blocks are handed out in scrambled order and
    every cache row starts as random garbage, so reading a wrong slot changes the answer."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    needed = [math.ceil(s / block_size) for _, s in runs]
    num_blocks = sum(needed) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in needed]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    dense_k = [torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype) for _, s in runs]
    dense_v = [torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype) for _, s in runs]
    # Store each request's earlier (cached) context straight into its slots.
    for b, (q_len, s) in enumerate(runs):
        for p in range(s - q_len):
            blk, off = tables[b][p // block_size], p % block_size
            k_cache[blk, off] = dense_k[b][p]
            v_cache[blk, off] = dense_v[b][p]
    meta = AttentionMetadata.build([q for q, _ in runs], [s for _, s in runs], tables,
                                   block_size, "cpu")
    query = torch.randn(meta.num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    key = torch.cat([dense_k[b][s - q:] for b, (q, s) in enumerate(runs)])
    value = torch.cat([dense_v[b][s - q:] for b, (q, s) in enumerate(runs)])
    return Scenario(query, key, value, k_cache, v_cache, meta, dense_k, dense_v)


def dense_attention(sc: Scenario, scale: float, window=None) -> torch.Tensor:
    """Causal attention on the unpaged per-request K/V, one query row at a time."""
    out = torch.empty_like(sc.query, dtype=torch.float32)
    num_heads, num_kv_heads = sc.query.shape[1], sc.dense_k[0].shape[1]
    group = num_heads // num_kv_heads
    t = 0
    for b, (q_len, seq_len) in enumerate(zip(sc.meta.query_lens, sc.meta.seq_lens_list)):
        for i in range(q_len):
            pos = seq_len - q_len + i
            lo = 0 if window is None else max(0, pos - window + 1)
            for h in range(num_heads):
                k = sc.dense_k[b][lo:pos + 1, h // group].float()   # [n, D]
                v = sc.dense_v[b][lo:pos + 1, h // group].float()
                w = torch.softmax(k @ sc.query[t, h].float() * scale, dim=0)
                out[t, h] = w @ v
            t += 1
    return out


def run(backend, sc: Scenario, scale: float, window=None) -> torch.Tensor:
    return backend.forward(sc.query, sc.key, sc.value, sc.k_cache, sc.v_cache, sc.meta,
                           scale, sliding_window=window)


def clone(sc: Scenario) -> Scenario:
    return Scenario(sc.query, sc.key, sc.value, sc.k_cache.clone(), sc.v_cache.clone(),
                    sc.meta, sc.dense_k, sc.dense_v)


MIXED = [(1, 40), (12, 30), (25, 25), (3, 17), (1, 1), (9, 50), (2, 2), (1, 33)]
MIXES = {
    "all_decode": [(1, s) for s in (1, 5, 16, 17, 40, 63, 9)],
    "all_prefill": [(20, 20), (33, 33), (9, 9), (1, 1)],
    "chunked_continuation": [(16, 48), (31, 40), (10, 11)],
    "mixed": MIXED,
}


# ---------------------------------------------------------------- metadata

def test_metadata_build_slots_and_offsets():
    meta = AttentionMetadata.build([3, 1], [5, 10], [[7, 2], [4, 0, 9]], 4, "cpu")
    # request 0: positions 2,3 in block 7, position 4 in block 2; request 1: position 9
    # in block 9 at offset 1.
    assert meta.slot_mapping.tolist() == [30, 31, 8, 37]
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    assert meta.seq_lens.tolist() == [5, 10]
    assert meta.block_tables.tolist() == [[7, 2, 0], [4, 0, 9]]
    assert meta.num_tokens == 4 and meta.max_query_len == 3 and meta.max_seq_len == 10
    assert meta.query_lens == [3, 1] and meta.seq_lens_list == [5, 10]
    for t in (meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables):
        assert t.dtype == torch.int64


@pytest.mark.parametrize("host_tokens", [0, 10**6])
def test_metadata_host_index_equals_tensor_path(monkeypatch, host_tokens):
    """Small steps index in plain ints (HOST_INDEX_TOKENS): every tensor, and a KV group's
    slots (with_tables), equal the tensor path's, whichever path the other side takes."""
    from tokenmill.layers.attention import metadata as metadata_module
    rng = random.Random(3)
    for _ in range(20):
        block_size = rng.choice([1, 4, 16])
        query_lens = [rng.choice([1, 1, 2, 4, 9, 40]) for _ in range(rng.randint(1, 6))]
        seq_lens = [q + rng.randint(0, 70) for q in query_lens]
        tables = [rng.sample(range(200), -(-s // block_size) + rng.randint(0, 2)) for s in seq_lens]
        other = [rng.sample(range(200), len(t)) for t in tables]
        metas = []
        for limit in (host_tokens, 256 - host_tokens if host_tokens == 0 else 0):
            monkeypatch.setattr(metadata_module, "HOST_INDEX_TOKENS", limit)
            meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, "cpu")
            metas.append((meta, meta.with_tables(other)))
        (a, a_other), (b, b_other) = metas
        for x, y in ((a.query_start_loc, b.query_start_loc), (a.slot_mapping, b.slot_mapping),
                     (a.seq_lens, b.seq_lens), (a.block_tables, b.block_tables),
                     (a_other.slot_mapping, b_other.slot_mapping), (a_other.block_tables, b_other.block_tables),
                     *zip(a.token_positions, b.token_positions)):
            assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape and torch.equal(x, y)


@pytest.mark.parametrize("args", [
    ([2], [1], [[0]], 4),           # query longer than context
    ([0], [3], [[0]], 4),           # empty run
    ([1], [9], [[0, 1]], 4),        # too few blocks
    ([1, 1], [1], [[0]], 4),        # length mismatch
    ([1], [1], [[0]], 0),           # bad block size
])
def test_metadata_build_rejects_bad_input(args):
    with pytest.raises(ValueError):
        AttentionMetadata.build(*args, "cpu")


# ---------------------------------------------------------------- write_kv

def test_write_kv_touches_only_addressed_slots():
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(6, 4, 2, 8, generator=gen)
    v_cache = torch.randn(6, 4, 2, 8, generator=gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([21, 3, 0, 17, 8])
    key = torch.randn(5, 2, 8, generator=gen)
    value = torch.randn(5, 2, 8, generator=gen)
    write_kv(key, value, k_cache, v_cache, slots)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(k_cache[s // 4, s % 4], key[i])
        assert torch.equal(v_cache[s // 4, s % 4], value[i])
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(k_cache.flatten(0, 1)[untouched], k_before.flatten(0, 1)[untouched])
    assert torch.equal(v_cache.flatten(0, 1)[untouched], v_before.flatten(0, 1)[untouched])


def test_write_kv_rejects_non_contiguous_cache():
    cache = torch.randn(4, 2, 4, 2, 8)[:, 0]        # strided view, not contiguous
    kv = torch.randn(1, 2, 8)
    with pytest.raises(ValueError):
        write_kv(kv, kv, cache, cache, torch.tensor([0]))


# ---------------------------------------------------------------- reference vs dense

@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("window", [None, 5])
def test_reference_matches_dense(block_size, num_heads, num_kv_heads, window):
    sc = make_scenario(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16,
                       block_size=block_size, seed=block_size)
    scale = 16 ** -0.5
    expected = dense_attention(sc, scale, window)
    got = run(ReferenceAttention(), sc, scale, window)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- cpu vs reference

def check_cpu_vs_reference(runs, *, num_heads, num_kv_heads, head_dim, block_size,
                           window=None, seed=0, dtype=torch.float32, atol=1e-5):
    sc = make_scenario(runs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, block_size=block_size, seed=seed, dtype=dtype)
    scale = head_dim ** -0.5
    ref_sc, cpu_sc = clone(sc), clone(sc)
    expected = run(ReferenceAttention(), ref_sc, scale, window)
    got = run(CpuAttention(), cpu_sc, scale, window)
    assert got.shape == sc.query.shape and got.dtype == sc.query.dtype
    torch.testing.assert_close(got, expected, atol=atol, rtol=atol)
    # Both must leave the cache in the same state.
    assert torch.equal(cpu_sc.k_cache, ref_sc.k_cache)
    assert torch.equal(cpu_sc.v_cache, ref_sc.v_cache)


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2)])  # GQA 1/3/4
@pytest.mark.parametrize("block_size", [1, 16])
def test_cpu_matches_reference_mixes(mix, num_heads, num_kv_heads, block_size):
    check_cpu_vs_reference(MIXES[mix], num_heads=num_heads, num_kv_heads=num_kv_heads,
                           head_dim=32, block_size=block_size, seed=num_heads)


@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("window", [None, 1, 7, 1000])
def test_cpu_matches_reference_head_dim_and_window(head_dim, window):
    check_cpu_vs_reference(MIXED, num_heads=9, num_kv_heads=3, head_dim=head_dim,
                           block_size=16, window=window, seed=head_dim)


def test_cpu_matches_reference_block_size_one_with_window():
    check_cpu_vs_reference(MIXED, num_heads=8, num_kv_heads=2, head_dim=32, block_size=1,
                           window=4)


@pytest.mark.parametrize("window", [1, 16, 50, 64, 200])
def test_cpu_windowed_prefill_tiles_match_reference(window):
    # Prefill runs far longer than the window, with and without cached context: the windowed
    # path reads only the keys each query tile can see (tiles of >= 64 rows, blocks of 16).
    runs = [(300, 300), (150, 700), (97, 161), (9, 500), (200, 210), (1, 333)]
    check_cpu_vs_reference(runs, num_heads=6, num_kv_heads=2, head_dim=32, block_size=16,
                           window=window, seed=window)


def test_cpu_prefill_after_context_in_query_tiles():
    # Chunks after a cached context attend in tiles of PREFILL_QUERY_TILE query rows, each
    # against the keys up to its last row: one, several and a partial last tile.
    from tokenmill.layers.attention.cpu import PREFILL_QUERY_TILE as T
    runs = [(2 * T + 44, 2 * T + 344), (T, T + 9), (T + 1, 3 * T), (30, 700)]
    check_cpu_vs_reference(runs, num_heads=6, num_kv_heads=2, head_dim=32, block_size=16, seed=3)


def test_cpu_long_runs_and_spec_like_runs():
    # Runs straddling the batched/per-request threshold, with and without cached context.
    runs = [(8, 8), (8, 20), (9, 9), (9, 30), (5, 37), (1, 64), (40, 100)]
    check_cpu_vs_reference(runs, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16)


def test_cpu_bf16_inputs_follow_reference():
    check_cpu_vs_reference(MIXED, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                           dtype=torch.bfloat16, atol=2e-2)


# ---------------------------------------------------------------- selection

def test_get_attention_backend():
    assert get_attention_backend("reference").name == "reference"
    assert get_attention_backend("cpu").name == "cpu"
    assert get_attention_backend().name == "cpu"
    with pytest.raises(ValueError, match="reference"):
        get_attention_backend("flash-nope")


def test_auto_backend_by_device(monkeypatch):
    from tokenmill.layers.attention import base
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert base.resolve_backend_name("auto", cpu) == "cpu"
    assert base.resolve_backend_name("reference", cuda) == "reference"
    monkeypatch.setattr(base, "_triton_installed", lambda: True)
    assert base.resolve_backend_name("auto", cuda) == "triton"
    monkeypatch.setattr(base, "_triton_installed", lambda: False)
    assert base.resolve_backend_name("auto", cuda) == "cpu"   # plain PyTorch on the GPU
