"""KV cache manager: per-request block tables over the block pools of the KV layout's groups
(kv/layout.py: full-attention layers in group 0, each sliding window in a group of its own).

Terms: a request's *computed* tokens have their K/V written in its blocks; *cached* tokens are
computed tokens that came for free from the prefix cache. Only full blocks are shared; KV waste
is the unused tail of each request's last block. A windowed group's blocks that the window has
passed go back to its pool; the table keeps the group's null block in their place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tokenmill.kv.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block
from tokenmill.kv.layout import NULL_BLOCK, KVLayout, first_live_block
from tokenmill.request import Request
from tokenmill.utils import cdiv


@dataclass
class PrefixCacheStats:
    num_queries: int = 0        # prompt tokens looked up
    num_hits: int = 0           # of those, served from the cache

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0


@dataclass
class PrefixHit:
    """Cached blocks of a request's prompt, per group (a windowed group's dead ones are its
    null block), covering its first ``num_tokens`` tokens."""

    blocks: tuple
    num_tokens: int


class _Group:
    """One group's pool and each request's table in it."""

    def __init__(self, num_blocks: int, window: Optional[int], enable_caching: bool) -> None:
        self.window = window
        # a windowed group's block 0: zeros the window has passed, read (masked), never written
        self.pool = BlockPool(num_blocks, enable_caching, reserved=int(window is not None))
        self.null = self.pool.blocks[NULL_BLOCK] if window is not None else None
        self.tables: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.reserved

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def most_blocks(self, num_tokens: int, max_step_tokens: int, block_size: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens, computed at most
        ``max_step_tokens`` a step, holds here at once: a window's keys before the step,
        the step's tokens, one partly used block."""
        needed = cdiv(num_tokens, block_size)
        if self.window is None:
            return needed
        return min(needed, cdiv(self.window - 1 + max_step_tokens, block_size) + 1)

    def drop_dead(self, request_id: str, num_computed: int, block_size: int) -> None:
        """Return the blocks no query from ``num_computed`` on can see (most recently passed
        last in the eviction order). The passed entries are a prefix of the table: walk
        back from the new end to the null entries of earlier steps."""
        table = self.tables.get(request_id)
        if self.window is None or not table:
            return
        start = end = min(first_live_block(num_computed, self.window, block_size), len(table))
        while start > 0 and table[start - 1] is not self.null:
            start -= 1
        dead = table[start:end]
        table[start:end] = [self.null] * (end - start)
        self.pool.free(dead)

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, [])
        self.pool.free(b for b in reversed(table) if b is not self.null)


class KVCacheManager:
    def __init__(self, layout: KVLayout, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self._enable_caching = enable_caching
        self.groups = [_Group(g.num_blocks, g.window, enable_caching) for g in layout.groups]
        self._hashes: dict[str, list[BlockHash]] = {}
        self.prefix_stats = PrefixCacheStats()

    # -- queries ----------------------------------------------------------------------------
    @property
    def pool(self) -> BlockPool:
        """Group 0's pool (the full-attention layers')."""
        return self.groups[0].pool

    @property
    def enable_caching(self) -> bool:
        return self._enable_caching

    def set_caching(self, enabled: bool) -> None:
        """Turn the prefix cache on or off (forgetting what it holds; only when idle)."""
        self.reset_prefix_cache()
        self._enable_caching = enabled
        for g in self.groups:
            g.pool.enable_caching = enabled

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only allowed when nothing is running."""
        if not self.all_free:
            return False
        return all([g.pool.reset_prefix_cache() for g in self.groups])

    @property
    def num_total_blocks(self) -> int:
        return self.groups[0].num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.groups[0].num_free_blocks

    @property
    def all_free(self) -> bool:
        return all(g.num_free_blocks == g.num_usable_blocks for g in self.groups)

    @property
    def usage(self) -> float:
        """The fullest group's share of blocks in use."""
        return max(1.0 - g.num_free_blocks / g.num_usable_blocks for g in self.groups)

    def block_ids(self, request_id: str) -> list[int]:
        """Group 0's table (the one drafters index their own caches with)."""
        return self.block_tables(request_id)[0]

    def block_tables(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in g.tables.get(request_id, [])] for g in self.groups)

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def shortfall(self, num_tokens: int, max_step_tokens: int) -> Optional[tuple[int, int]]:
        """(blocks needed, blocks held) of the first group whose pool can never hold a request
        of ``num_tokens`` tokens computed at most ``max_step_tokens`` a step; None if all can."""
        for g in self.groups:
            needed = g.most_blocks(num_tokens, max_step_tokens, self.block_size)
            if needed > g.num_usable_blocks:
                return needed, g.num_usable_blocks
        return None

    def max_request_tokens(self, max_step_tokens: int) -> Optional[int]:
        """The most tokens a request may reach (``shortfall`` is None up to there); None: no
        limit (every group slides, and its pool holds a window and a step)."""
        limit = None
        for g in self.groups:
            tokens = g.num_usable_blocks * self.block_size
            if g.most_blocks(tokens + 1, max_step_tokens, self.block_size) > g.num_usable_blocks:
                limit = tokens if limit is None else min(limit, tokens)
        return limit

    def _block_hashes(self, request: Request, num_tokens: int) -> list[BlockHash]:
        """Content keys of the request's full blocks among its first num_tokens tokens."""
        hashes = self._hashes.setdefault(request.request_id, [])
        num_full = num_tokens // self.block_size
        while len(hashes) < num_full:
            i = len(hashes)
            tokens = request.token_slice(i * self.block_size, (i + 1) * self.block_size)
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens, request.cache_salt))
        return hashes[:num_full]

    def get_computed_blocks(self, request: Request) -> tuple[PrefixHit, int]:
        """Longest cached prefix of full blocks that every group can serve: a full-attention
        group needs all its blocks, a windowed one those its window sees from the prefix's
        end. The last token is always left to compute, because its logits are needed to sample."""
        none = PrefixHit(tuple([] for _ in self.groups), 0)
        if not self.enable_caching or request.needs_every_prompt_row:
            return none, 0   # prompt logprobs and mean pooling read every prompt position
        keys = self._block_hashes(request, request.num_tokens - 1)
        n = len(keys)
        for g in self.groups:   # a full-attention group's first miss bounds the hit
            if g.window is None:
                n = next((i for i, key in enumerate(keys[:n]) if g.pool.lookup(key) is None), n)
        found = [[g.pool.lookup(key) for key in keys[:n]] for g in self.groups]
        while n > 0 and not all(self._serves(g, hits, n) for g, hits in zip(self.groups, found)):
            n -= 1
        self.prefix_stats.num_queries += request.num_tokens
        self.prefix_stats.num_hits += n * self.block_size
        if n == 0:
            return none, 0
        blocks = []
        for g, hits in zip(self.groups, found):
            live = first_live_block(n * self.block_size, g.window, self.block_size)
            blocks.append([g.null] * live + hits[live:n])
        return PrefixHit(tuple(blocks), n * self.block_size), n * self.block_size

    def _serves(self, group: _Group, hits: list, n: int) -> bool:
        live = first_live_block(n * self.block_size, group.window, self.block_size)
        return all(b is not None for b in hits[live:n])

    # -- allocation ---------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       hit: Optional[PrefixHit] = None) -> Optional[tuple[list[int], ...]]:
        """Make room for ``num_new_tokens`` more tokens after the computed (and cached) ones.
        Returns each group's ids of newly added blocks, or None (no block taken) if a pool is
        short. Blocks a window has passed are returned first."""
        rid = request.request_id
        hit_blocks = hit.blocks if hit is not None else tuple([] for _ in self.groups)
        start = request.num_computed_tokens + (hit.num_tokens if hit is not None else 0)
        total_blocks = self.num_blocks_needed(start + num_new_tokens)
        counts = []
        for g, cached in zip(self.groups, hit_blocks):
            g.drop_dead(rid, start, self.block_size)
            num_new = max(0, total_blocks - len(g.tables.get(rid, [])) - len(cached))
            # cache hits that sit in the free queue stop being allocatable once touched
            revived = sum(1 for b in cached if b.ref_cnt == 0)
            if num_new > g.num_free_blocks - revived:
                return None
            counts.append(num_new)
        added = []
        for g, cached, num_new in zip(self.groups, hit_blocks, counts):
            g.pool.touch(b for b in cached if b is not g.null)
            blocks = list(cached) + g.pool.allocate(num_new)
            g.tables.setdefault(rid, []).extend(blocks)
            added.append([b.block_id for b in blocks])
        return tuple(added)

    def cache_computed_blocks(self, request: Request) -> None:
        """Publish the request's now fully computed blocks to the prefix cache."""
        if not self.enable_caching:
            return
        # Only tokens the request holds are verified: accepted drafts are appended after this
        # call and rejected ones never are, so a block with unverified tokens is never keyed.
        num_verified = min(request.num_computed_tokens, request.num_tokens)
        keys = self._block_hashes(request, num_verified)
        for g in self.groups:
            for block, key in zip(g.tables.get(request.request_id, []), keys):
                if block is not g.null:
                    g.pool.publish(block, key)

    def free(self, request_id: str) -> None:
        """Release a request's blocks. Tail blocks go first into the eviction queue, so shared
        prefixes outlive the unique suffixes that hang off them."""
        self._hashes.pop(request_id, None)
        for g in self.groups:
            g.free(request_id)

    def reset_hashes(self, request_id: str) -> None:
        self._hashes.pop(request_id, None)

    @property
    def num_tracked_requests(self) -> int:
        return len(self.groups[0].tables)
