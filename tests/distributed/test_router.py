"""Routers on plain token lists (no engine, no torch): which replica a prompt goes to."""
import pytest

from tokenmill.distributed.router import (PrefixAwareRouter, RoundRobinRouter, least_loaded,
                                          make_router)

BLOCK = 4


def prompt(*blocks, tail=(99,)):
    """Token ids made of whole blocks (each a distinct start value) plus a short tail."""
    ids = []
    for start in blocks:
        ids += list(range(start, start + BLOCK))
    return ids + list(tail)


def test_round_robin_ignores_content():
    router = RoundRobinRouter(3)
    same = prompt(10, 20)
    assert [router.route(same, [0, 0, 0]) for _ in range(5)] == [0, 1, 2, 0, 1]


def test_least_loaded_breaks_ties_by_lowest_index():
    assert least_loaded([2, 1, 1]) == 1
    with pytest.raises(ValueError):
        least_loaded([])


def test_no_full_block_goes_to_the_least_loaded_replica():
    router = PrefixAwareRouter(2, BLOCK)
    # exactly one block: the last token is always recomputed, so no block can hit
    assert router.prefix_keys(list(range(BLOCK))) == []
    assert router.route(list(range(BLOCK)), [3, 1]) == 1
    assert router.route([5, 6], [0, 4]) == 0
    assert len(router) == 0


def test_shared_prefix_goes_to_the_replica_that_served_it():
    router = PrefixAwareRouter(2, BLOCK)
    first = router.route(prompt(10, 20, 30), [1, 0])        # least loaded: 1
    assert first == 1
    # a later turn of the same conversation, with the other replica now idler
    assert router.route(prompt(10, 20, 30, 40), [2, 1]) == 1
    # another question behind the same system prompt (first block shared only)
    assert router.route(prompt(10, 77), [3, 2]) == 1
    # an unrelated prompt is not pulled there
    assert router.route(prompt(50, 60), [0, 3]) == 0


def test_deepest_known_prefix_decides():
    router = PrefixAwareRouter(3, BLOCK, max_load_imbalance=8)
    assert router.route(prompt(10, 20), [0, 0, 0]) == 0          # owner of [10] and [10, 20]
    assert router.route(prompt(10, 21), [5, 0, 0]) == 0          # shares [10]; 5 <= 8 more
    router = PrefixAwareRouter(3, BLOCK, max_load_imbalance=2)
    router.route(prompt(10, 20), [0, 0, 0])                      # [10], [10, 20] -> 0
    router.route(prompt(10, 21), [3, 0, 0])                      # 0 too busy: [10], [10, 21] -> 1
    assert router.route(prompt(10, 20, 30), [1, 1, 0]) == 0      # [10, 20] is still 0's
    assert router.route(prompt(10, 22), [1, 1, 0]) == 0          # [10] moved to 0 again


def test_next_turn_finds_its_history_behind_a_long_shared_system_prompt():
    router = PrefixAwareRouter(2, BLOCK)
    system = (10, 20, 30, 40, 50, 60)                        # six blocks everyone shares
    assert router.route(prompt(*system, 100), [0, 0]) == 0   # conversation A
    assert router.route(prompt(*system, 200), [5, 0]) == 1   # B: replica 0 too busy
    # the system prompt's keys now name replica 1, but A's own blocks still name 0
    assert router.route(prompt(*system, 100, 110), [1, 1]) == 0
    assert router.route(prompt(*system, 200, 210), [1, 1]) == 1


def test_overloaded_owner_hands_the_prefix_to_the_least_loaded():
    router = PrefixAwareRouter(2, BLOCK, max_load_imbalance=2)
    assert router.route(prompt(10, 20), [0, 0]) == 0
    assert router.route(prompt(10, 20), [2, 0]) == 0      # imbalance 2: still allowed
    assert router.route(prompt(10, 20), [3, 0]) == 1      # 3 > 2: least loaded, new owner
    assert router.route(prompt(10, 20), [3, 3]) == 1      # remembered


def test_salt_separates_prefixes():
    router = PrefixAwareRouter(2, BLOCK)
    ids = prompt(10, 20)
    assert router.prefix_keys(ids, "a") != router.prefix_keys(ids, "b") != router.prefix_keys(ids)
    assert router.route(ids, [0, 0], cache_salt="a") == 0
    assert router.route(ids, [1, 0], cache_salt="b") == 1     # unknown under salt b
    assert router.route(ids, [1, 1], cache_salt="a") == 0


def test_only_the_first_blocks_are_hashed():
    assert len(PrefixAwareRouter(2, BLOCK).prefix_keys(list(range(40 * BLOCK)))) == 32
    router = PrefixAwareRouter(2, BLOCK, max_blocks=2)
    assert len(router.prefix_keys(prompt(10, 20, 30, 40))) == 2
    assert router.route(prompt(10, 20, 30), [0, 0]) == 0
    assert router.route(prompt(10, 20, 31), [1, 0]) == 0      # differs past block 2 only


def test_memory_is_bounded_least_recent_forgotten():
    router = PrefixAwareRouter(2, BLOCK, max_blocks=1, capacity=3)
    for start in (10, 20, 30):
        router.route(prompt(start), [0, 0])                  # all owned by 0
    router.route(prompt(10), [0, 0])                         # 10 is fresh again
    router.route(prompt(40), [0, 0])                         # evicts 20, the least recent
    assert len(router) == 3
    assert router.route(prompt(20), [1, 0]) == 1             # forgotten: least loaded
    assert router.route(prompt(10), [1, 0]) == 0             # kept


def test_forget_replica_drops_its_prefixes():
    router = PrefixAwareRouter(2, BLOCK)
    router.route(prompt(10, 20), [0, 0])
    router.forget_replica(0)
    assert len(router) == 0
    assert router.route(prompt(10, 20), [1, 0]) == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_replicas=0, block_size=4), "num_replicas"),
    (dict(num_replicas=2, block_size=0), "block_size"),
    (dict(num_replicas=2, block_size=4, max_blocks=0), "max_blocks"),
    (dict(num_replicas=2, block_size=4, capacity=0), "capacity"),
    (dict(num_replicas=2, block_size=4, max_load_imbalance=-1), "max_load_imbalance"),
])
def test_bad_arguments_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PrefixAwareRouter(**kwargs)


def test_loads_must_match_the_replicas():
    with pytest.raises(ValueError, match="2 loads for 3 replicas"):
        PrefixAwareRouter(3, BLOCK).route(prompt(10), [0, 0])
    with pytest.raises(ValueError, match="1 loads for 2 replicas"):
        RoundRobinRouter(2).route(prompt(10), [0])
    with pytest.raises(ValueError, match="router must be"):
        make_router("random", 2, BLOCK)
    assert isinstance(make_router("prefix", 2, BLOCK), PrefixAwareRouter)
    assert isinstance(make_router("round_robin", 2, BLOCK), RoundRobinRouter)
