"""A tensor-parallel group: this process's rank, the group's size, and the collectives the
parallel layers call. Rank 0 of 1 has no process group and every collective is the identity,
so single-process code pays nothing.

Process groups are gloo on CPU and NCCL on CUDA (torch.distributed). Every rank of a group
receives the same bytes from ``all_reduce`` / ``all_gather`` (ring algorithms end with an
all-gather of the reduced chunks), which is what lets every rank sample the same token from
the same gathered logits.
"""
from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Optional[object] = None       # torch ProcessGroup; None when size == 1
    # Shared-memory collectives of ranks on one CPU host (distributed/shm_comm.py); the
    # process group serves what does not fit, and everything when None.
    shm: Optional[object] = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError("a tensor-parallel group of more than one rank needs a process group")

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks (in place when parallel); the result on every rank."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        x = x.contiguous()
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_reduce_max(x)
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` (same shape on all ranks) along ``dim``."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_gather(x, dim)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def gather(self, x: torch.Tensor, dim: int = -1, dst: int = 0) -> Optional[torch.Tensor]:
        """Concatenation along ``dim`` on rank ``dst``; None on the other ranks."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == dst else None
        dist.gather(x, parts, dst=dst, group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)


SINGLE = TPGroup()


def init_tp_group(rank: int, size: int, master_addr: str, master_port: int,
                  device: torch.device, timeout_s: float, shm_collectives: bool = True) -> TPGroup:
    """Join the ``size``-rank group rendezvousing at master_addr:master_port (TCP store).
    ``shm_collectives``: CPU ranks (all on one host: the executors place them so) also
    share a memory segment for small collectives."""
    if size == 1:
        return SINGLE
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                            rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    shm = None
    if shm_collectives and device.type == "cpu":
        from tokenmill.distributed.shm_comm import open_shm_communicator
        shm = open_shm_communicator(rank, size, f"tokenmill_tp_{master_port}", dist.group.WORLD,
                                    timeout_s)
    return TPGroup(rank, size, dist.group.WORLD, shm)


def destroy_tp_group(group: TPGroup) -> None:
    if group.shm is not None:
        group.shm.close()
    if group.size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def split_evenly(total: int, size: int, what: str) -> int:
    """``total / size``, or a clear error when the split is uneven."""
    if total % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the {total} {what}")
    return total // size


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (the rendezvous binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
