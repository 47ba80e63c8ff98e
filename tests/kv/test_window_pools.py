"""Sliding-window layers keep only their window's KV blocks, in pools of their own
(kv/layout.py): the layout's sizes, the manager's tables and prefix hits, and engines whose
outputs are the same bits as with one table over every layer."""
import pytest

from tests.models.test_fused_architectures import _save_tiny
from tests.models.test_tiny_architectures import assert_matches_hf
from tokenmill import LLM, SamplingParams
from tokenmill.kv.kv_cache_manager import KVCacheManager
from tokenmill.kv.layout import (NULL_BLOCK, KVGroup, KVLayout, first_live_block, kv_bytes_read,
                                 plan_kv_layout, window_blocks_bound)
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams as Params

GEMMA_LIKE = tuple(512 if (i + 1) % 6 else None for i in range(18))   # 15 sliding, 3 full


def _plan(windows, num_blocks, **over):
    kw = dict(explicit_blocks=False, max_num_seqs=64, max_step_tokens=2048, free_windows=True,
              primary_shared=False)
    return plan_kv_layout(windows, num_blocks, 16, **{**kw, **over})


def test_a_window_group_gets_what_its_requests_can_hold_and_group_0_the_rest():
    layout = _plan(GEMMA_LIKE, 7000)
    full, window = layout.groups
    need = window_blocks_bound(512, 16, 64, 2048)
    assert need == (64 * 511 + 2048) // 16 + 128
    assert full.layers == (5, 11, 17) and full.window is None
    assert window.window == 512 and len(window.layers) == 15 and window.num_blocks == need + 1
    # the same bytes: the layer-blocks the window group does not take go to the full layers
    assert full.num_blocks == (7000 * 18 - 15 * (need + 1)) // 3
    assert full.num_blocks * 3 + window.num_blocks * 15 <= 7000 * 18
    assert layout.group_of_window() == {None: 0, 512: 1}
    explicit = _plan(GEMMA_LIKE, 7000, explicit_blocks=True)
    assert explicit.groups[0].num_blocks == 7000 and explicit.groups[1] == window


def test_one_table_where_a_window_would_save_nothing_or_is_turned_off():
    need = window_blocks_bound(512, 16, 64, 2048)
    assert len(_plan(GEMMA_LIKE, need + 1).groups) == 1          # the window pool is no smaller
    assert _plan(GEMMA_LIKE, 7000, free_windows=False).groups == (KVGroup(tuple(range(18)), None, 7000),)
    assert len(_plan((None,) * 4, 7000).groups) == 1
    mistral = (4096,) * 4   # every layer slides: group 0 frees its window, unless a drafter
    #                         indexes caches of its own through group 0's table
    assert _plan(mistral, 70000).groups == (
        KVGroup((0, 1, 2, 3), 4096, window_blocks_bound(4096, 16, 64, 2048) + 1),)
    assert _plan(mistral, 70000, primary_shared=True).groups == (KVGroup((0, 1, 2, 3), None, 70000),)


def _req(rid, tokens):
    return Request(rid, tokens, Params(max_tokens=8), max_tokens=8)


def _layout(full_blocks=50, window_blocks=20):
    return KVLayout((KVGroup((1,), None, full_blocks), KVGroup((0, 2), 8, window_blocks)), (8, None, 8))


def _prefill(kv, req, chunk=16):
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
        kv.cache_computed_blocks(req)


def test_a_window_group_returns_the_blocks_its_window_passed():
    kv = KVCacheManager(_layout(), block_size=4)
    a = _req("a", list(range(40)))
    _prefill(kv, a)
    full, window = kv.block_tables("a")
    assert len(full) == len(window) == 10 and NULL_BLOCK not in full[1:]
    live = first_live_block(32, 8, 4)   # the last chunk started at 32
    assert window[:live] == [NULL_BLOCK] * live and NULL_BLOCK not in window[live:]
    assert kv.groups[1].num_free_blocks == 19 - (10 - live)
    for _ in range(30):   # decode: the window group holds a bounded number of blocks
        assert kv.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
        a.append_output_token(5)
        held = [b for b in kv.block_tables("a")[1] if b != NULL_BLOCK]
        assert len(held) <= 8 // 4 + 2
    assert len(kv.block_tables("a")[0]) == 18 and kv.groups[0].num_free_blocks == 50 - 18
    kv.free("a")
    assert kv.all_free


def test_a_prefix_hit_needs_the_window_group_only_where_the_window_sees():
    kv = KVCacheManager(_layout(), block_size=4)
    a = _req("a", list(range(40)))
    _prefill(kv, a)
    kv.free("a")
    window_pool = kv.groups[1].pool
    b = _req("b", list(range(40)) + [7])
    assert kv.get_computed_blocks(b)[1] == 40
    keys = kv._block_hashes(b, 40)
    # forget the window's block 2 (long passed at position 40): the hit stays whole
    window_pool._evict(window_pool.lookup(keys[2]))
    assert kv.get_computed_blocks(b)[1] == 40
    # forget block 9 (the window at 40 reads it): the longest hit whose window is cached is 36
    window_pool._evict(window_pool.lookup(keys[9]))
    hit, n = kv.get_computed_blocks(b)
    assert n == 36
    live = first_live_block(36, 8, 4)
    assert [x.block_id for x in hit.blocks[1]] == [NULL_BLOCK] * live + [
        window_pool.lookup(k).block_id for k in keys[live:9]]
    assert [x.block_id for x in hit.blocks[0]] == [kv.groups[0].pool.lookup(k).block_id for k in keys[:9]]
    assert kv.allocate_slots(b, 5, hit) is not None
    assert kv.block_tables("b")[1][:live] == [NULL_BLOCK] * live


def test_a_window_group_admits_any_length_that_its_window_fits():
    kv = KVCacheManager(KVLayout((KVGroup((0,), 8, 12),), (8,)), block_size=4)
    assert kv.shortfall(100_000, max_step_tokens=16) is None       # 7 + 16 keys: 7 blocks
    assert kv.shortfall(100_000, max_step_tokens=64) == (19, 11)
    assert kv.max_request_tokens(16) is None and kv.max_request_tokens(64) == 44
    full = KVCacheManager(KVLayout.single(12), block_size=4)
    assert full.shortfall(100, max_step_tokens=16) == (25, 12)
    assert full.max_request_tokens(16) == 48 and full.shortfall(48, 16) is None


# Engines: tiny random models whose sliding windows (8) are far shorter than the prompts.
PROMPTS = [[(11 * i + 5 * j) % 250 + 3 for j in range(n)] for i, n in enumerate([3, 13, 40, 21, 9, 57, 2, 33])]


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    return {name: _save_tiny(name, tmp_path_factory.mktemp(name)) for name in ("gemma3", "mistral")}


def _run(path, pools: bool, backend: str = "cpu", **over):
    kw = dict(skip_tokenizer_init=True, block_size=4, num_kv_blocks=400, max_num_seqs=32,
              max_num_batched_tokens=16, attention_backend=backend)
    llm = LLM(model=path, sliding_window_pools=pools, **{**kw, **over})
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    out = []
    for _ in range(2):   # the second round hits the prefix cache
        for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False):
            c = o.outputs[0]
            out.append((c.token_ids, [e[t].logprob for t, e in zip(c.token_ids, c.logprobs)]))
    return llm, out


@pytest.mark.parametrize("name,backend", [("gemma3", "cpu"), ("gemma3", "reference"), ("mistral", "cpu")])
def test_window_pools_give_the_same_bits(tiny_paths, name, backend):
    """Chunked prefill (16 tokens a step), decode through the fused C stack (cpu), prefix hits."""
    pooled, out = _run(tiny_paths[name][1], True, backend)
    layout = pooled.engine.kv_layout
    windows = [g.window for g in layout.groups]
    assert windows == ({"gemma3": [None, 8], "mistral": [8]}[name])
    assert layout.groups[-1].num_blocks == window_blocks_bound(8, 4, 32, 16) + 1 < 400
    hits = pooled.engine.scheduler.kv.prefix_stats.num_hits
    one_table, ref = _run(tiny_paths[name][1], False, backend)
    assert one_table.engine.kv_layout.groups == (KVGroup((0, 1, 2), None, 400),)
    assert out == ref
    assert hits == one_table.engine.scheduler.kv.prefix_stats.num_hits > 0


def test_a_decode_step_reads_a_window_layers_kv_over_its_window_only(tiny_paths):
    """What the benchmarks' memory floors count (bench compare, quant, gpu)."""
    assert kv_bytes_read(1800, GEMMA_LIKE, 100) == 1800 * 100
    assert kv_bytes_read(1800, GEMMA_LIKE, 8192) == 100 * (15 * 512 + 3 * 8192)
    assert kv_bytes_read(1800, [], 4096) == 1800 * 4096   # no layers named: all full
    engine = LLM(model=tiny_paths["gemma3"][1], skip_tokenizer_init=True, num_kv_blocks=64,
                 block_size=4).engine
    assert engine.layer_windows == (8, None, 8)
    per_layer = engine.kv_bytes_per_token / 3
    assert engine.kv_bytes_read(5) == int(3 * per_layer * 5)
    assert engine.kv_bytes_read(100) == int(per_layer * (8 + 100 + 8))


def test_window_pools_under_preemption_give_the_same_tokens(tiny_paths):
    """A pool too small for every request at once: preemption and recompute."""
    pooled, out = _run(tiny_paths["gemma3"][1], True, num_kv_blocks=40, max_num_seqs=4)
    assert len(pooled.engine.kv_layout.groups) == 2 and pooled.engine.scheduler.num_preemptions > 0
    _, ref = _run(tiny_paths["gemma3"][1], False, num_kv_blocks=40, max_num_seqs=4)
    assert [tokens for tokens, _ in out] == [tokens for tokens, _ in ref]


def test_the_runner_tables_follow_the_scheduler_and_hide_what_the_window_passed(tiny_paths):
    llm = LLM(model=tiny_paths["gemma3"][1], skip_tokenizer_init=True, block_size=4, num_kv_blocks=400,
              max_num_seqs=32, max_num_batched_tokens=16)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i, p in enumerate(PROMPTS[2:6]):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    most_held = 0
    window_group = engine.scheduler.kv.groups[1]
    while engine.has_unfinished_requests():
        started = {rid: r.num_computed_tokens for rid, r in engine.scheduler.requests.items()}
        engine.step()
        for rid, state in engine.runner.states.items():
            if rid not in engine.scheduler.requests:
                continue
            tables = engine.scheduler.kv.block_tables(rid)
            assert [list(t) for t in tables] == state.block_tables
            # what no query of the step could see (from where it started) is the null block
            live = first_live_block(started.get(rid, 0), 8, 4)
            assert state.block_tables[1][:live] == [NULL_BLOCK] * live
            assert NULL_BLOCK not in state.block_tables[0]
        most_held = max(most_held, window_group.num_usable_blocks - window_group.num_free_blocks)
    # four requests of 51-87 tokens: one table would hold up to 56 blocks at once; the window
    # group holds each request's last 7 keys and its step's tokens (16 at most over all)
    assert 0 < most_held <= (4 * 7 + 16) // 4 + 2 * 4


def test_gemma3_with_window_pools_still_equals_hf(tmp_path):
    hf, path = _save_tiny("gemma3", tmp_path)
    llm = LLM(model=path, skip_tokenizer_init=True, num_kv_blocks=64, block_size=4, max_num_seqs=4,
              max_num_batched_tokens=16)
    assert [g.window for g in llm.engine.kv_layout.groups] == [None, 8]
    assert_matches_hf(hf, llm)
