"""All-reduce and all-gather through shared memory, for tensor-parallel ranks on one host.

gloo moves even a 2 KB decode activation over loopback TCP with its own threads: ~0.1 ms
at best and often several ms on a small VM, paid twice per layer per step. Ranks on one
host can instead write their piece to a shared slot, meet at a barrier on flags in the
same segment (layers/cpu_sync.c), and read everyone's pieces: a few microseconds.

Layout: one 64-byte flag line per rank, then two banks of one slot per rank. Call ``seq``
uses bank ``seq % 2``; a rank overwrites a bank only at call seq + 2, after every rank
passed the barrier of call seq + 1, i.e. after everyone finished reading call seq. So one
barrier per collective suffices. Every rank sums the slots in rank order, so all ranks
hold bit-identical results (what lets each sample the same token).

Messages larger than a slot go to the fallback (the gloo group).
"""
from __future__ import annotations

import mmap
import os
from typing import Optional

import torch

FLAG_BYTES = 64
DEFAULT_SLOT_BYTES = 4 << 20
SHM_DIR = "/dev/shm"


class ShmCommunicator:
    def __init__(self, name: str, rank: int, world: int, create: bool, timeout_s: float,
                 slot_bytes: int = DEFAULT_SLOT_BYTES) -> None:
        from tokenmill.layers import native
        self.lib = native.require()
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.slot_bytes = slot_bytes
        size = FLAG_BYTES * world + 2 * world * slot_bytes
        # A plain file in /dev/shm mapped by every rank (not multiprocessing.shared_memory:
        # its resource tracker, shared by spawned ranks, would unlink or complain twice).
        self.path = os.path.join(SHM_DIR, name)
        fd = os.open(self.path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)   # zero-filled: every flag starts at step 0
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._flags = torch.frombuffer(self._map, dtype=torch.int64, count=8 * world)
        self._flags_ptr = self._flags.data_ptr()
        base = FLAG_BYTES * world
        self._slots = [[torch.frombuffer(self._map, dtype=torch.uint8, count=slot_bytes,
                                         offset=base + (bank * world + r) * slot_bytes)
                        for r in range(world)] for bank in range(2)]
        self.seq = 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() * x.element_size() <= self.slot_bytes

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Publish ``x``; return every rank's piece (views into the shared bank)."""
        self.seq += 1
        bank = self._slots[self.seq % 2]
        nbytes = x.numel() * x.element_size()
        pieces = [s[:nbytes].view(x.dtype).view(x.shape) for s in bank]
        pieces[self.rank].copy_(x)
        if self.lib.tm_shm_barrier(self._flags_ptr, self.rank, self.world, self.seq,
                                   self.timeout_s):
            raise RuntimeError(f"a tensor-parallel peer did not reach all-reduce {self.seq} "
                               f"within {self.timeout_s:.0f} s")
        return pieces

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks into ``x`` (contiguous), rank order on every rank."""
        pieces = self._exchange(x)
        x.copy_(pieces[0])
        for piece in pieces[1:]:
            x.add_(piece)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        pieces = self._exchange(x)
        x.copy_(pieces[0])
        for piece in pieces[1:]:
            torch.maximum(x, piece, out=x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat(self._exchange(x), dim=dim)   # cat copies out before reuse

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self._flags = self._slots = None
        try:
            self._map.close()
        except BufferError:   # a view still alive somewhere: the OS frees it at exit
            pass


def open_shm_communicator(rank: int, world: int, name: str, group, timeout_s: float
                          ) -> Optional[ShmCommunicator]:
    """Rank 0 creates the segment, the others attach, then rank 0 unlinks the name (the
    mapping lives on until the last rank exits: nothing is left in /dev/shm, even after a
    crash). None on every rank when any rank cannot (no kernel library, no /dev/shm): gloo
    serves."""
    import torch.distributed as dist
    from tokenmill.layers import native
    usable = native.library() is not None and os.path.isdir(SHM_DIR)
    ok = torch.tensor([1 if usable else 0], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if not int(ok):
        return None
    comm = ShmCommunicator(name, rank, world, create=True, timeout_s=timeout_s) if rank == 0 else None
    dist.barrier(group=group)
    if rank != 0:
        comm = ShmCommunicator(name, rank, world, create=False, timeout_s=timeout_s)
    dist.barrier(group=group)
    if rank == 0:
        comm.unlink()
    return comm
