"""The "ray" backend of tensor parallelism: one Ray actor per rank, each a RankWorker.

Rank 0's actor picks the rendezvous (its node's address and a free port), then every actor
joins the group and loads its shard. Calls carry msgpack bytes only; a Ray actor runs one
caller's calls in the order they were made, so every rank sees the same sequence of steps.
``ray`` is imported only here, when this backend is chosen.
"""
from __future__ import annotations

import dataclasses
import logging

from tokenmill.distributed import serial
from tokenmill.distributed.parallel_state import free_port
from tokenmill.runner.executor import WorkerFailedError, step_result
from tokenmill.runner.worker import RankSpec

logger = logging.getLogger("tokenmill.ray_executor")


class RankActor:
    """Wrapped with ``ray.remote`` at start-up (so this module imports without Ray)."""

    def __init__(self, spec_bytes: bytes) -> None:
        import torch
        self.spec: RankSpec = serial.decode(spec_bytes)
        torch.set_num_threads(self.spec.num_threads)
        self.worker = None

    def rendezvous(self) -> tuple:
        import ray
        addr = ray.util.get_node_ip_address()
        return addr, free_port(addr)

    def load(self, addr: str, port: int) -> bytes:
        from tokenmill.distributed.parallel_state import init_tp_group
        from tokenmill.runner.worker import RankWorker, _rank_device
        s = self.spec
        tp = init_tp_group(s.rank, s.world_size, addr, port, _rank_device(s.rank, s.device),
                           s.collective_timeout_s, s.shm_collectives)
        self.worker = RankWorker(s, tp)
        return serial.encode(self.worker.load())

    def handle(self, request: bytes) -> bytes:
        kind, payload = serial.decode(request)
        return serial.encode(self.worker.handle(kind, payload))


class RayExecutor:
    model = None    # the weights live in the actors
    runner = None

    def __init__(self, spec: RankSpec, parallel, num_threads: int) -> None:
        import ray
        if not ray.is_initialized():
            if parallel.ray_address is None:   # a local cluster on the rendezvous address
                ray.init(address="local", include_dashboard=False,
                         _node_ip_address=parallel.master_addr,
                         object_store_memory=200 * 1024**2)
            else:
                ray.init(address=parallel.ray_address)
        size = parallel.tensor_parallel_size
        self.world_size = size
        threads = max(1, num_threads // size)
        # Tensor parallelism stays inside one node (its collectives run per layer): the ranks'
        # CPU bundles are packed onto a single node of the cluster.
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        self.placement = ray.util.placement_group([{"CPU": threads}] * size, strategy="STRICT_PACK")
        self._stopped = False
        self.actors = []
        try:
            ray.get(self.placement.ready(), timeout=parallel.collective_timeout_s)
        except Exception:
            self.shutdown()
            raise WorkerFailedError(f"the Ray cluster has no node with {size * threads} free CPUs "
                                    f"for {size} tensor-parallel ranks") from None
        actor_cls = ray.remote(num_cpus=threads)(RankActor)
        self.actors = [actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            self.placement, placement_group_bundle_index=r)).remote(serial.encode(
                dataclasses.replace(spec, rank=r, world_size=size, num_threads=threads)))
            for r in range(size)]
        try:
            addr, port = self._get([self.actors[0].rendezvous.remote()])[0]
            infos = self._get([a.load.remote(addr, port) for a in self.actors])
            self.info = [serial.decode(b) for b in infos]
        except BaseException:
            self.shutdown()
            raise

    def _get(self, refs: list) -> list:
        import ray
        try:
            return ray.get(refs)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
            self.shutdown()
            raise WorkerFailedError(f"a tensor-parallel Ray actor failed: {e}") from None

    def _call_all(self, kind: str, payload) -> list:
        if self._stopped:
            raise WorkerFailedError("the tensor-parallel actors have stopped")
        request = serial.encode((kind, payload))
        return [serial.decode(b) for b in self._get([a.handle.remote(request) for a in self.actors])]

    def init_cache(self, kv_layout, block_size: int) -> int:
        return self._call_all("init_cache", (kv_layout, block_size))[0]

    def call_all(self, kind: str, payload) -> list:
        return self._call_all(kind, payload)

    def rank0_call(self, kind: str):
        return self._call_all(kind, None)[0]

    def execute(self, so):
        return step_result(self._call_all("execute", so))

    def release(self, req_ids) -> None:
        self._call_all("release", sorted(req_ids))

    def memory(self) -> list[dict]:
        return self._call_all("memory", None)

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        import ray
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:
                pass
        try:
            ray.util.remove_placement_group(self.placement)
        except Exception:
            pass
