from tokenmill.kv.kv_cache_manager import KVCacheManager
from tokenmill.kv.layout import KVLayout
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams


def _req(rid, tokens, salt=None):
    return Request(rid, tokens, SamplingParams(max_tokens=8), max_tokens=8, cache_salt=salt)


def test_allocation_waste_is_only_last_block_tail():
    kv = KVCacheManager(KVLayout.single(10), block_size=4)
    r = _req("a", list(range(10)))
    assert kv.allocate_slots(r, 10) is not None
    assert len(kv.block_ids("a")) == 3          # ceil(10 / 4)
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 1) == ([],)     # 11th token fits the tail
    r.num_computed_tokens = 12
    assert len(kv.allocate_slots(r, 1)[0]) == 1


def test_allocate_fails_atomically_when_short():
    kv = KVCacheManager(KVLayout.single(2), block_size=4)
    r = _req("a", list(range(12)))
    assert kv.allocate_slots(r, 12) is None
    assert kv.num_free_blocks == 2 and kv.block_ids("a") == []


def test_prefix_hit_leaves_last_token_and_shares_blocks():
    kv = KVCacheManager(KVLayout.single(10), block_size=4)
    a = _req("a", list(range(9)))
    kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.cache_computed_blocks(a)
    b = _req("b", list(range(8)))               # exactly two full blocks cached
    blocks, n = kv.get_computed_blocks(b)
    assert n == 4                               # last token must be recomputed: only 1 block
    c = _req("c", list(range(9)) + [99])
    blocks, n = kv.get_computed_blocks(c)
    assert n == 8
    kv.allocate_slots(c, 2, blocks)
    assert kv.block_ids("c")[:2] == kv.block_ids("a")[:2]
    kv.free("a")
    kv.free("c")
    assert kv.num_free_blocks == 10


def test_different_salts_never_share():
    kv = KVCacheManager(KVLayout.single(10), block_size=4)
    a = _req("a", list(range(9)), salt="x")
    kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.cache_computed_blocks(a)
    assert kv.get_computed_blocks(_req("b", list(range(9)), salt="y"))[1] == 0
    assert kv.get_computed_blocks(_req("c", list(range(9)), salt="x"))[1] == 8


def test_caching_disabled_finds_nothing():
    kv = KVCacheManager(KVLayout.single(10), block_size=4, enable_caching=False)
    a = _req("a", list(range(9)))
    kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.cache_computed_blocks(a)
    assert kv.get_computed_blocks(_req("b", list(range(9))))[1] == 0
