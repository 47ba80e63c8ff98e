"""Paged attention of speculative draft trees (cpu_attention.c's key_swap): a leaf
alternative at depth d sits at position ctx + d, the chain node's, but its K/V were written
at the slot of its index position ctx + i. Its row must have exactly the bits of the same
token verified as the chain node at depth d (a cache holding its K/V at ctx + d), or
greedy tree verification would accept tokens a chain would not; and it must agree with the
reference backend."""
import pytest
import torch

from tokenmill.layers import cpu_ops, native
from tokenmill.layers.attention.base import AttentionBackend
from tokenmill.layers.attention.cpu import MAX_BATCHED_QUERY_LEN, CpuAttention
from tokenmill.layers.attention.kv_quant import QuantizedKV, dequantize_kv, quantize_kv
from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.layers.attention.reference import ReferenceAttention
from tests.layers.block_tables import shuffled_block_tables
from tests.layers.test_cpu_ops import _kv_caches

# Skipped only where the kernels cannot exist; where they should, a failed build fails here.
pytestmark = pytest.mark.skipif(not native.buildable(), reason="no C compiler, or a CPU without AVX2")

KV_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]
# (Hq, Hkv, D): SmolLM2's GQA; one KV head; D % 32 != 0 (the per-KV-head loops, not attend_heads)
SHAPES = [(9, 3, 64), (4, 1, 32), (4, 2, 16)]
# contexts before each request's run: short rows; rows straddling the split at 2 threads
# (ATT_SPLIT_MIN x 2 = 64 keys: ctx 62's root has 63, its depth-1 nodes 64); rows split in
# two runs. "pair": few requests (split rows' runs are the parallel tasks); "batch": many
# (one task per request, split rows run by run inside it)
REQUESTS = {"one-5": [5], "one-20": [20], "one-62": [62], "one-70": [70], "pair": [20, 70],
            "batch": [3, 5, 20, 62, 70]}
BS, THREADS, SCALE = 4, 2, 0.125
CHAIN = 3   # draft chain length; one leaf alternative at each depth 1..CHAIN


def _copy_slot(cache, src: int, dst: int) -> None:
    """The stored row of slot src (values, and an int8 cache's scales) into slot dst."""
    parts = (cache.values, cache.scale) if isinstance(cache, QuantizedKV) else (cache,)
    for t in parts:
        flat = t.flatten(0, 1)
        flat[dst] = flat[src]


def _clone(cache):
    if isinstance(cache, QuantizedKV):
        return QuantizedKV(cache.values.clone(), cache.scale.clone())
    return cache.clone()


def _dequantized(cache) -> torch.Tensor:
    if isinstance(cache, QuantizedKV):
        return cache.index_select(0, torch.arange(cache.shape[0]))
    return cache


def _slot(table: list[int], pos: int) -> int:
    return table[pos // BS] * BS + pos % BS


def _tree_positions(ctx: int, alternatives: int = 1) -> list[int]:
    """Root, the chain's nodes at depths 1..CHAIN, then ``alternatives`` leaves at each depth."""
    chain = [ctx + d for d in range(CHAIN + 1)]
    return chain + [ctx + d for d in range(1, CHAIN + 1) for _ in range(alternatives)]


def _attend(q, k_cache, v_cache, q_lens, seq_lens, tables, window, q_pos=None, scale=SCALE):
    """cpu_ops.paged_attention on THREADS threads; every row must be written."""
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, BS, "cpu")
    out = torch.full_like(q, float("nan"))
    saved = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        assert cpu_ops.paged_attention(q, k_cache, v_cache, meta.block_tables,
                                       meta.query_start_loc[:-1], torch.tensor(q_lens),
                                       meta.seq_lens, scale, window, out, q_pos=q_pos)
    finally:
        torch.set_num_threads(saved)
    assert not out.isnan().any()
    return out


def _tree_batch(ctxs, kv_dtype, shape, seed, alternatives=1):
    """Requests with a draft tree each after contexts ``ctxs`` (random caches, shuffled
    blocks): (q, k_cache, v_cache, q_lens, seq_lens, tables, q_pos [T])."""
    hq, hkv, d = shape
    g = torch.Generator().manual_seed(seed)
    q_lens = [len(_tree_positions(c, alternatives)) for c in ctxs]
    seq_lens = [c + n for c, n in zip(ctxs, q_lens)]
    nblocks = sum(-(-s // BS) for s in seq_lens) + 3
    tables = shuffled_block_tables(seq_lens, BS, nblocks, g)
    k_cache, v_cache = _kv_caches(kv_dtype, (nblocks, BS, hkv, d), g)
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    q_pos = torch.tensor([p for c in ctxs for p in _tree_positions(c, alternatives)])
    return q, k_cache, v_cache, q_lens, seq_lens, tables, q_pos


def _check_tree_rows_equal_chains(ctxs, kv_dtype, shape, window, seed):
    q, k_cache, v_cache, q_lens, seq_lens, tables, q_pos = _tree_batch(ctxs, kv_dtype, shape, seed)
    tree = _attend(q, k_cache, v_cache, q_lens, seq_lens, tables, window, q_pos)
    starts = [sum(q_lens[:b]) for b in range(len(ctxs))]
    # the root and the chain sit at their index positions: q_pos changes nothing for them
    plain = _attend(q, k_cache, v_cache, q_lens, seq_lens, tables, window)
    for s in starts:
        assert torch.equal(tree[s:s + CHAIN + 1], plain[s:s + CHAIN + 1])
    for depth in range(1, CHAIN + 1):
        # each request's run as a chain whose node at `depth` is the alternative: its K/V
        # stored canonically at ctx + depth, the rows root .. depth
        kc, vc = _clone(k_cache), _clone(v_cache)
        rows = []
        for c, s, table in zip(ctxs, starts, tables):
            alt = CHAIN + depth   # the alternative's index in the run
            for cache in (kc, vc):
                _copy_slot(cache, _slot(table, c + alt), _slot(table, c + depth))
            rows += list(range(s, s + depth)) + [s + alt]
        chain = _attend(q[rows], kc, vc, [depth + 1] * len(ctxs), [c + depth + 1 for c in ctxs],
                        tables, window)
        alt_rows = [s + CHAIN + depth for s in starts]
        assert torch.equal(tree[alt_rows], chain[depth::depth + 1]), f"depth {depth}"


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hq%d-hkv%d-d%d" % s)
@pytest.mark.parametrize("requests", list(REQUESTS))
@pytest.mark.parametrize("window", [None, 6, 70])   # 70: rows of ctx 70 split their window
def test_tree_rows_are_bit_identical_to_chain_rows(kv_dtype, shape, requests, window):
    _check_tree_rows_equal_chains(REQUESTS[requests], kv_dtype, shape, window, seed=len(requests))


@pytest.mark.skipif(not (native.has_vnni() and native.buildable()), reason="one build only here")
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
def test_tree_rows_in_both_builds(kv_dtype, both_builds, monkeypatch):
    """The AVX2 build (2 heads per K / V load, 8-wide updates) swaps the same key: its tree
    rows equal its chain rows, and the AVX-512 build's bits."""
    outs = []
    for lib in both_builds:
        monkeypatch.setattr(native, "library", lambda lib=lib: lib)
        for requests in ("one-70", "batch"):
            _check_tree_rows_equal_chains(REQUESTS[requests], kv_dtype, (9, 3, 64), None, seed=7)
        q, k_cache, v_cache, q_lens, seq_lens, tables, q_pos = _tree_batch(
            REQUESTS["batch"], kv_dtype, (9, 3, 64), seed=8)
        outs.append(_attend(q, k_cache, v_cache, q_lens, seq_lens, tables, None, q_pos))
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def _round_trip(x: torch.Tensor, kv_dtype) -> torch.Tensor:
    """x as an int8 cache gives it back (the reference's float caches must hold that)."""
    return dequantize_kv(*quantize_kv(x, kv_dtype)) if kv_dtype is torch.int8 else x


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hq%d-hkv%d-d%d" % s)
@pytest.mark.parametrize("requests", ["one-70", "pair", "batch"])
@pytest.mark.parametrize("window", [None, 6, 70])
def test_cpu_backend_matches_the_reference_on_trees(kv_dtype, shape, requests, window):
    """CpuAttention.forward with query_positions: two alternatives per depth make runs of
    10 rows (> MAX_BATCHED_QUERY_LEN, still the paged kernel, not the prefill one), close to
    the reference backend (on float caches holding the int8 cache's values), and the bits
    of cpu_ops.paged_attention's direct call."""
    hq, hkv, d = shape
    q, k_cache, v_cache, q_lens, seq_lens, tables, q_pos = _tree_batch(
        REQUESTS[requests], kv_dtype, shape, seed=3, alternatives=2)
    assert max(q_lens) > MAX_BATCHED_QUERY_LEN
    g = torch.Generator().manual_seed(4)
    key, value = (torch.randn(q.shape[0], hkv, d, generator=g) for _ in range(2))

    def meta():   # a fresh one per call: plan_cache is per step
        m = AttentionMetadata.build(q_lens, seq_lens, tables, BS, "cpu")
        m.query_positions = q_pos.clone()
        return m
    scale = d ** -0.5
    kc, vc = _clone(k_cache), _clone(v_cache)
    saved = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        got = CpuAttention().forward(q, key, value, kc, vc, meta(), scale, window)
        direct = _attend(q, kc, vc, q_lens, seq_lens, tables, window, q_pos, scale)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(got, direct)
    want = ReferenceAttention().forward(
        q, _round_trip(key, kv_dtype), _round_trip(value, kv_dtype), _dequantized(k_cache).clone(),
        _dequantized(v_cache).clone(), meta(), scale, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_runs_beside_a_tree_keep_their_own_paths():
    """A prompt chunk and a plain decode row in a step with a draft tree: the tree takes the
    paged kernel, the others the paths (and bits) they take in a step without one."""
    shape, hkv, d = (9, 3, 64), 3, 64
    q, k_cache, v_cache, q_lens, seq_lens, tables, q_pos = _tree_batch([20, 33, 9], torch.float32, shape, 8)
    # request 0: a prompt chunk of 12 rows (positions 8..19 of its 20 + 7 tree slots: keep
    # its table, only 20 keys); request 2: one plain decode row at its index position
    q_lens2 = [12, q_lens[1], 1]
    seq_lens2 = [20, seq_lens[1], 10]
    rows = list(range(8, 20)) + list(range(q_lens[0], q_lens[0] + q_lens[1])) + [q_lens[0] + q_lens[1]]
    q2 = q[:sum(q_lens2)].clone()
    pos = torch.cat([torch.arange(8, 20), q_pos[q_lens[0]:q_lens[0] + q_lens[1]], torch.tensor([9])])
    g = torch.Generator().manual_seed(9)
    key, value = (torch.randn(q2.shape[0], hkv, d, generator=g) for _ in range(2))
    assert len(rows) == q2.shape[0]

    def forward(tree: bool):
        meta = AttentionMetadata.build(q_lens2, seq_lens2, tables, BS, "cpu")
        meta.prompt_runs = (True, False, False)
        meta.query_positions = pos.clone() if tree else None
        saved = torch.get_num_threads()
        torch.set_num_threads(THREADS)
        try:
            return CpuAttention().forward(q2, key, value, k_cache.clone(), v_cache.clone(), meta, SCALE)
        finally:
            torch.set_num_threads(saved)
    with_tree, without = forward(True), forward(False)
    assert torch.equal(with_tree[:12], without[:12])      # the prompt chunk: prefill bits
    assert torch.equal(with_tree[-1:], without[-1:])      # the decode row
    assert not torch.equal(with_tree[12:-1], without[12:-1])   # the tree's alternatives moved


def test_reference_tree_row_equals_its_chain_row():
    """The oracle itself: an alternative's row is the row of a chain holding it at its
    position (values, so exact float32 equality is not required, only close)."""
    q, k_cache, v_cache, q_lens, seq_lens, tables, q_pos = _tree_batch([9], torch.float32, (4, 2, 32), 5)
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, BS, "cpu")
    meta.query_positions = q_pos
    slots = meta.slot_mapping
    k_new, v_new = k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]
    tree = ReferenceAttention().forward(q, k_new, v_new, k_cache.clone(), v_cache.clone(), meta,
                                        SCALE)
    for depth in range(1, CHAIN + 1):
        alt = CHAIN + depth
        rows = list(range(depth)) + [alt]
        chain_meta = AttentionMetadata.build([depth + 1], [9 + depth + 1], tables, BS, "cpu")
        chain = ReferenceAttention().forward(q[rows], k_new[rows], v_new[rows], k_cache.clone(),
                                             v_cache.clone(), chain_meta, SCALE)
        torch.testing.assert_close(tree[alt], chain[depth], rtol=1e-6, atol=1e-6)


def test_trees_without_the_c_kernel_are_refused():
    """The PyTorch paths would attend the chain node's key in place of an alternative's:
    a wrong answer, so CpuAttention raises instead; backends say whether they take trees."""
    q, k_cache, v_cache, q_lens, seq_lens, tables, q_pos = _tree_batch([5], torch.float32, (4, 2, 32), 6)
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, BS, "cpu")
    meta.query_positions = q_pos
    key = value = torch.zeros(q.shape[0], 2, 32)
    backend = CpuAttention(cpu_kernels=False)
    assert not backend.supports_draft_trees
    with pytest.raises(ValueError, match="draft trees need the C attention kernel"):
        backend.forward(q, key, value, k_cache, v_cache, meta, SCALE)
    assert CpuAttention().supports_draft_trees == cpu_ops.available()
    assert AttentionBackend.supports_draft_trees is False
    assert ReferenceAttention().supports_draft_trees is False


def test_query_positions_are_checked_and_shared_by_kv_groups():
    """A position past its index position (it would see later keys) or below 0 (outside the
    block table) is refused before any kernel reads it; a KV group's metadata keeps them."""
    q_lens, seq_lens, tables = [3, 2], [7, 4], [[0, 1], [2]]
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, BS, "cpu")
    assert meta.checked_query_positions() is None
    meta.query_positions = torch.tensor([4, 5, 5, 2, 3])
    assert torch.equal(meta.checked_query_positions(), meta.query_positions)
    group = meta.with_tables([[3, 4], [5]])
    assert group.query_positions is meta.query_positions
    for bad in ([4, 5, 7, 2, 3], [4, 5, 6, 2, -1], [4, 5, 6, 2]):
        meta = AttentionMetadata.build(q_lens, seq_lens, tables, BS, "cpu")
        meta.query_positions = torch.tensor(bad)
        with pytest.raises(ValueError, match="query_positions"):
            meta.checked_query_positions()


def test_the_c_stack_verifies_trees_with_the_modules_bits(tiny_llama_dir):
    """The one-call decoder stack (runner/fused_stack.py) hands query_positions to its
    attention: a tree step's hidden states equal the modules' bits (CpuAttention through the
    same kernel); without them the alternatives' rows change and the chain's do not."""
    from tokenmill import LLM
    from tokenmill.runner import fused_stack
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, enable_prefix_caching=False,
              block_size=BS, num_kv_blocks=64)
    model, runner = llm.engine.model, llm.engine.runner
    g = torch.Generator().manual_seed(9)
    for k, v in runner.kv_caches:   # earlier context: random K/V
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    saved = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    ctxs = [5, 20]
    q_lens = [len(_tree_positions(c)) for c in ctxs]
    seq_lens = [c + n for c, n in zip(ctxs, q_lens)]
    tables = shuffled_block_tables(seq_lens, BS, 64, g)
    q_pos = torch.tensor([p for c in ctxs for p in _tree_positions(c)], dtype=torch.int64)
    ids = torch.randint(3, 384, (q_pos.shape[0],), generator=g)

    def step(fused: bool, tree: bool = True):
        for (k, v), (k0, v0) in zip(runner.kv_caches, saved):
            k.copy_(k0)
            v.copy_(v0)
        meta = AttentionMetadata.build(q_lens, seq_lens, tables, BS, "cpu")
        meta.query_positions = q_pos.clone() if tree else None
        if fused:
            out = fused_stack.forward(model, ids, q_pos, runner.kv_caches, meta, runner.backend)
            assert out is not None, "the C stack stepped aside"
            return out
        return model(ids, q_pos, runner.kv_caches, meta, runner.backend)
    fused = step(True)
    assert torch.equal(fused, step(False))
    chains = step(True, tree=False)   # the same RoPE positions, every row's own slot canonical
    starts = [0, q_lens[0]]
    for s in starts:
        assert torch.equal(fused[s:s + CHAIN + 1], chains[s:s + CHAIN + 1])
        alternatives = slice(s + CHAIN + 1, s + q_lens[0])
        assert not torch.equal(fused[alternatives], chains[alternatives])
