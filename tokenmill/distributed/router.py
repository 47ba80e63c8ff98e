"""Routers: which data-parallel replica serves a request. Pure Python, no torch.

A replica's prefix cache only helps requests that reach that replica, so the prefix-aware
router sends a prompt whose first KV blocks were seen before to the replica that served them
(the next turn of a conversation, a shared system prompt), unless that replica is busier than
the least-loaded one by more than ``max_load_imbalance`` requests: then the least-loaded
replica takes it and becomes the prefix's owner. Load = requests in flight on a replica.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Optional, Sequence

from tokenmill.kv.block_pool import hash_block


def least_loaded(loads: Sequence[int]) -> int:
    """Index of the smallest load; the lowest index among ties (deterministic)."""
    if not loads:
        raise ValueError("no replica to route to")
    return min(range(len(loads)), key=lambda i: loads[i])


def _check_loads(loads: Sequence[int], num_replicas: int) -> None:
    if len(loads) != num_replicas:
        raise ValueError(f"got {len(loads)} loads for {num_replicas} replicas")


class RoundRobinRouter:
    """Replicas in turn, whatever the prompt."""

    def __init__(self, num_replicas: int) -> None:
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive integer, got {num_replicas!r}")
        self.num_replicas = num_replicas
        self._next = itertools.cycle(range(num_replicas))

    def route(self, prompt_token_ids: Sequence[int], loads: Sequence[int],
              cache_salt: Optional[str] = None) -> int:
        _check_loads(loads, self.num_replicas)
        return next(self._next)


class PrefixAwareRouter:
    """Prompts that share their first full KV blocks go to the same replica.

    A prompt's key chain is the chained block hashes (the prefix cache's own, salt included)
    of its first ``max_blocks`` full blocks among all but its last token (the engine always
    recomputes the last token, so only those blocks can hit). The deepest key already known
    names the owner. ``max_blocks`` reaches well past a typical system prompt: were every key
    inside the shared system prompt, all conversations would look alike and the next turn
    of one could not find the replica holding its history. Keys live in an LRU of
    ``capacity`` entries, so memory stays bounded."""

    def __init__(self, num_replicas: int, block_size: int, max_blocks: int = 32,
                 max_load_imbalance: int = 4, capacity: int = 65536) -> None:
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive integer, got {num_replicas!r}")
        for name, value in (("block_size", block_size), ("max_blocks", max_blocks),
                            ("capacity", capacity)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(max_load_imbalance, int) or max_load_imbalance < 0:
            raise ValueError(f"max_load_imbalance must be an integer >= 0, got {max_load_imbalance!r}")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.max_load_imbalance = max_load_imbalance
        self.capacity = capacity
        self._owners: "OrderedDict[bytes, int]" = OrderedDict()   # block-chain digest -> replica

    def __len__(self) -> int:
        return len(self._owners)

    def prefix_keys(self, prompt_token_ids: Sequence[int],
                    cache_salt: Optional[str] = None) -> list[bytes]:
        """Digests of the prompt's first full blocks, shallowest first (may be empty)."""
        num_full = min(self.max_blocks, max(0, len(prompt_token_ids) - 1) // self.block_size)
        keys, parent = [], None
        for i in range(num_full):
            parent = hash_block(parent, prompt_token_ids[i * self.block_size:(i + 1) * self.block_size],
                                cache_salt)
            keys.append(parent.digest)
        return keys

    def route(self, prompt_token_ids: Sequence[int], loads: Sequence[int],
              cache_salt: Optional[str] = None) -> int:
        _check_loads(loads, self.num_replicas)
        keys = self.prefix_keys(prompt_token_ids, cache_salt)
        coolest = least_loaded(loads)
        if not keys:
            return coolest
        owner = self._owner_of(keys)
        if owner is None or loads[owner] - loads[coolest] > self.max_load_imbalance:
            owner = coolest
        self._remember(keys, owner)
        return owner

    def forget_replica(self, replica: int) -> None:
        """Drop every prefix owned by ``replica`` (it died or left)."""
        for key in [k for k, r in self._owners.items() if r == replica]:
            del self._owners[key]

    def _owner_of(self, keys: list[bytes]) -> Optional[int]:
        for key in reversed(keys):          # the deepest shared prefix decides
            owner = self._owners.get(key)
            if owner is not None:
                return owner
        return None

    def _remember(self, keys: list[bytes], owner: int) -> None:
        for key in keys:
            self._owners[key] = owner
            self._owners.move_to_end(key)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)


def make_router(kind: str, num_replicas: int, block_size: int):
    """The router ParallelConfig.router names."""
    if kind == "prefix":
        return PrefixAwareRouter(num_replicas, block_size)
    if kind == "round_robin":
        return RoundRobinRouter(num_replicas)
    raise ValueError(f"router must be 'prefix' or 'round_robin', got {kind!r}")
