"""KV cache manager: per-request block tables over the shared block pool.

Terms: a request's *computed* tokens have their K/V written in its blocks; *cached* tokens are
computed tokens that came for free from the prefix cache. Only full blocks are shared; KV waste
is the unused tail of each request's last block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tokenmill.kv.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block
from tokenmill.request import Request
from tokenmill.utils import cdiv


@dataclass
class PrefixCacheStats:
    num_queries: int = 0        # prompt tokens looked up
    num_hits: int = 0           # of those, served from the cache

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self.prefix_stats = PrefixCacheStats()

    # -- queries ----------------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, [])]

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _block_hashes(self, request: Request, num_tokens: int) -> list[BlockHash]:
        """Content keys of the request's full blocks among its first num_tokens tokens."""
        hashes = self._hashes.setdefault(request.request_id, [])
        num_full = num_tokens // self.block_size
        while len(hashes) < num_full:
            i = len(hashes)
            tokens = request.token_slice(i * self.block_size, (i + 1) * self.block_size)
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens, request.cache_salt))
        return hashes[:num_full]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks. The last token is always left to compute,
        because its logits are needed to sample."""
        if not self.enable_caching or request.needs_every_prompt_row:
            return [], 0   # prompt logprobs and mean pooling read every prompt position
        max_tokens = request.num_tokens - 1
        hits: list[KVCacheBlock] = []
        for key in self._block_hashes(request, max_tokens):
            block = self.pool.lookup(key)
            if block is None:
                break
            hits.append(block)
        self.prefix_stats.num_queries += request.num_tokens
        self.prefix_stats.num_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    # -- allocation ---------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: Optional[list[KVCacheBlock]] = None) -> Optional[list[int]]:
        """Make room for ``num_new_tokens`` more tokens after the computed (and cached) ones.
        Returns the ids of newly added blocks, or None (nothing changed) if the pool is short."""
        cached_blocks = cached_blocks or []
        held = self._blocks.get(request.request_id, [])
        num_cached_tokens = len(cached_blocks) * self.block_size
        total = request.num_computed_tokens + num_cached_tokens + num_new_tokens
        num_new_blocks = max(0, self.num_blocks_needed(total) - len(held) - len(cached_blocks))
        # Cache hits that sit in the free queue stop being allocatable once touched.
        revived = sum(1 for b in cached_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - revived:
            return None
        self.pool.touch(cached_blocks)
        new_blocks = self.pool.allocate(num_new_blocks)
        self._blocks[request.request_id] = held + cached_blocks + new_blocks
        return [b.block_id for b in cached_blocks + new_blocks]

    def cache_computed_blocks(self, request: Request) -> None:
        """Publish the request's now fully computed blocks to the prefix cache."""
        if not self.enable_caching:
            return
        blocks = self._blocks.get(request.request_id, [])
        # Only tokens the request holds are verified: accepted drafts are appended after this
        # call and rejected ones never are, so a block with unverified tokens is never keyed.
        num_verified = min(request.num_computed_tokens, request.num_tokens)
        for block, key in zip(blocks, self._block_hashes(request, num_verified)):
            self.pool.publish(block, key)

    def free(self, request_id: str) -> None:
        """Release a request's blocks. Tail blocks go first into the eviction queue, so shared
        prefixes outlive the unique suffixes that hang off them."""
        blocks = self._blocks.pop(request_id, [])
        self._hashes.pop(request_id, None)
        self.pool.free(reversed(blocks))

    def reset_hashes(self, request_id: str) -> None:
        self._hashes.pop(request_id, None)

    @property
    def num_tracked_requests(self) -> int:
        return len(self._blocks)
