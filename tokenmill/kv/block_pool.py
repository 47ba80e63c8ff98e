"""Block pool: the fixed set of KV blocks, their refcounts, and the prefix-cache index.

Pure Python. A block is *free* when no running request holds it (ref_cnt == 0). A free block
may still carry a cached prefix (its ``block_hash``): it stays findable until the pool needs it
and evicts it. Free blocks wait in an eviction-ordered queue: least recently freed first. A
freed block with no cached prefix (every block when caching is off, a request's partly
filled last block when it is on) goes to the front instead: reusing it evicts nothing, and
its memory is already resident, where a never-used block would be touched for the first time
(the process's RSS would grow toward the whole pool over a long run).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Optional


@dataclass(frozen=True)
class BlockHash:
    """Content key of one full block: sha256 over the parent digest, the block's token ids and
    an optional cache salt. The token ids and parent are kept so a lookup compares contents
    instead of trusting the digest alone (an injected collision is never reused)."""

    digest: bytes
    parent: Optional[bytes]
    token_ids: tuple
    salt: Optional[str]


def hash_block(parent: Optional[BlockHash], token_ids: Iterable[int],
               salt: Optional[str] = None) -> BlockHash:
    tokens = tuple(int(t) for t in token_ids)
    h = hashlib.sha256()
    parent_digest = parent.digest if parent is not None else None
    h.update(parent_digest or b"root")
    h.update(b"|salt:" + (salt.encode("utf-8") if salt is not None else b"-"))
    h.update(b"|tokens:" + b",".join(str(t).encode() for t in tokens))
    return BlockHash(h.digest(), parent_digest, tokens, salt)


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[BlockHash] = None
        self.prev_free: Optional[KVCacheBlock] = None
        self.next_free: Optional[KVCacheBlock] = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks; O(1) pop from the front, append, and removal from the
    middle (a cache hit revives a free block)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        block.prev_free, block.next_free = prev, prev.next_free
        prev.next_free.prev_free = block
        prev.next_free = block
        self.num_free += 1

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVCacheBlock:
        if self.num_free == 0:
            raise RuntimeError("no free KV blocks")
        block = self._head.next_free
        self.remove(block)
        return block

    def __iter__(self):
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, reserved: int = 0) -> None:
        """``reserved``: the first blocks are held for good (a windowed group's null block)."""
        if num_blocks < reserved + 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks - reserved}")
        self.num_blocks = num_blocks
        self.reserved = reserved
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        for block in self.blocks[:reserved]:
            block.ref_cnt = 1
        self.free_queue = FreeBlockQueue(self.blocks[reserved:])
        self._cached: dict[bytes, KVCacheBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to allocate, counting cached-but-unreferenced ones."""
        return self.free_queue.num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def lookup(self, key: BlockHash) -> Optional[KVCacheBlock]:
        block = self._cached.get(key.digest)
        if block is None or block.block_hash != key:   # contents compared, not just the digest
            return None
        return block

    def allocate(self, num: int) -> list[KVCacheBlock]:
        if num > self.free_queue.num_free:
            raise RuntimeError(f"asked for {num} KV blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(num):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the eviction queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each. Pass blocks in eviction order (first = evicted first);
        a block without a cached prefix is reused before any other."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of KV block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def publish(self, block: KVCacheBlock, key: BlockHash) -> None:
        """Make a fully computed block findable by its content key."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if key.digest in self._cached:      # same content computed twice: keep the first copy
            return
        block.block_hash = key
        self._cached[key.digest] = block

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash.digest) is block:
                del self._cached[block.block_hash.digest]
            block.block_hash = None
            self.num_evictions += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only allowed when nothing is running."""
        if self.free_queue.num_free != self.num_blocks - self.reserved:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        return True
