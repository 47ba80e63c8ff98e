import pytest

from tokenmill.kv.block_pool import BlockHash, BlockPool, hash_block


def test_allocate_and_free_returns_every_block():
    pool = BlockPool(8)
    blocks = pool.allocate(5)
    assert pool.num_free_blocks == 3
    assert len({b.block_id for b in blocks}) == 5
    pool.free(blocks)
    assert pool.num_free_blocks == 8


def test_allocate_more_than_free_raises():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.allocate(3)


def test_double_free_raises():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b])


def test_eviction_order_is_least_recently_freed_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for i, block in enumerate((a, b, c)):
        pool.publish(block, hash_block(None, [i]))
    pool.free([c])
    pool.free([a])
    pool.free([b])
    assert [x.block_id for x in pool.allocate(3)] == [c.block_id, a.block_id, b.block_id]


@pytest.mark.parametrize("caching", [True, False])
def test_a_block_without_cached_content_is_reused_first(caching):
    """Reusing a freed block that caches nothing evicts nothing and touches no new memory:
    it comes before never-used blocks and before cached ones (a run with caching off then
    keeps reusing the blocks it already touched instead of walking the whole pool)."""
    pool = BlockPool(6, enable_caching=caching)
    cached, plain, other = pool.allocate(3)            # blocks 3.. 5 never used yet
    pool.publish(cached, hash_block(None, [1, 2]))
    pool.free([cached, plain])
    pool.free([other])
    again = pool.allocate(2)
    assert [b.block_id for b in again] == [other.block_id, plain.block_id]
    assert pool.lookup(hash_block(None, [1, 2])) is (cached if caching else None)
    pool.free(again)
    for _ in range(20):                                 # a long run of short requests
        pool.free(pool.allocate(2))
    assert {b.block_id for b in pool.allocate(2)} == {other.block_id, plain.block_id}


def test_cached_block_survives_free_until_evicted():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    key = hash_block(None, [1, 2, 3, 4])
    pool.publish(a, key)
    pool.free([a])
    assert pool.lookup(key) is a            # free but still findable
    pool.touch([a])                          # a hit revives it
    assert pool.num_free_blocks == 1 and a.ref_cnt == 1
    pool.free([a])
    pool.allocate(2)                         # pool needs it: evicted
    assert pool.lookup(key) is None
    assert pool.num_evictions == 1


def test_hash_depends_on_parent_tokens_and_salt():
    root = hash_block(None, [1, 2])
    assert hash_block(None, [1, 2]) == root
    assert hash_block(None, [1, 3]).digest != root.digest
    assert hash_block(root, [1, 2]).digest != root.digest
    assert hash_block(None, [1, 2], salt="a").digest != hash_block(None, [1, 2], salt="b").digest
    # "12" + "3" vs "1" + "23" must not collide through naive concatenation
    assert hash_block(None, [12, 3]).digest != hash_block(None, [1, 23]).digest


def test_injected_digest_collision_is_not_reused():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    real = hash_block(None, [5, 6])
    pool.publish(a, real)
    forged = BlockHash(real.digest, None, (7, 8), None)   # same digest, other contents
    assert pool.lookup(forged) is None
    assert pool.lookup(real) is a
