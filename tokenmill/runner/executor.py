"""Executors: between the engine core (scheduler) and the model's ranks.

- ``InProcessExecutor``: tensor_parallel_size 1; the rank lives in the engine's process and
  is called directly (today's path, no serialization, no overhead).
- ``MultiprocExecutor``: one spawned process per rank (mp backend) or one Ray actor per
  rank (ray backend). Each step's SchedulerOutput goes to every rank msgpack-encoded; rank
  0's ModelRunnerOutput comes back. A rank that dies or fails raises ``WorkerFailedError``
  in the engine (never a hang): the executor then stops every rank.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import time
from typing import Optional

from tokenmill.distributed import serial
from tokenmill.distributed.parallel_state import SINGLE, free_port
from tokenmill.runner.worker import RankInfo, RankSpec, RankWorker, StepFailure, worker_process_main

logger = logging.getLogger("tokenmill.executor")


class WorkerFailedError(RuntimeError):
    """A tensor-parallel rank died or raised; the engine must stop."""


class StepFailedError(RuntimeError):
    """Executing one step raised on some rank; the ranks are fine, the step's requests are
    not (the engine fails the one at fault and re-runs the others)."""

    def __init__(self, failure: StepFailure) -> None:
        super().__init__(f"{failure.error_type}: {failure.message}")
        self.error_type = failure.error_type


def step_result(replies: list):
    """Rank 0's ModelRunnerOutput from every rank's reply to a step; StepFailedError if any
    rank's step raised."""
    failures = [r for r in replies if isinstance(r, StepFailure)]
    if failures:
        raise StepFailedError(failures[0])
    return replies[0]


class InProcessExecutor:
    world_size = 1

    def __init__(self, spec: RankSpec, checkpoint=None) -> None:
        self.worker = RankWorker(spec, SINGLE)
        self.info: list[RankInfo] = [self.worker.load(checkpoint)]

    @property
    def model(self):
        return self.worker.model

    @property
    def runner(self):
        return self.worker.runner

    def init_cache(self, kv_layout, block_size: int) -> int:
        return self.worker.init_cache(kv_layout, block_size)

    def execute(self, so):
        return step_result([self.worker.execute_step(so)])

    def release(self, req_ids) -> None:
        self.worker.runner.release(req_ids)

    def rank0_call(self, kind: str):
        return self.worker.handle(kind, None)

    def call_all(self, kind: str, payload) -> list:
        return [self.worker.handle(kind, payload)]

    def memory(self) -> list[dict]:
        return [self.worker.memory()]

    def shutdown(self) -> None:
        pass


class MultiprocExecutor:
    """``spec`` describes rank 0; ranks 1.. are copies with their own rank. Threads per
    rank: ``num_threads`` (all cores by default) split evenly."""

    POLL_S = 0.5

    def __init__(self, spec: RankSpec, world_size: int, num_threads: int,
                 load_timeout_s: float = 1800.0) -> None:
        self.world_size = world_size
        port = spec.master_port or free_port(spec.master_addr)
        ctx = multiprocessing.get_context("spawn")
        self.procs, self.conns = [], []
        self._pending: dict[int, list] = {rank: [] for rank in range(world_size)}
        self._stopped = False
        try:
            for rank in range(world_size):
                rank_spec = dataclasses.replace(spec, rank=rank, world_size=world_size,
                                                master_port=port,
                                                num_threads=max(1, num_threads // world_size))
                parent, child = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=worker_process_main, args=(serial.encode(rank_spec), child),
                                   name=f"tokenmill-tp{rank}", daemon=True)
                proc.start()
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
            self.info: list[RankInfo] = [self._reply(rank, load_timeout_s)
                                         for rank in range(world_size)]
        except BaseException:
            self.shutdown()
            raise

    model = None    # the weights live in the workers
    runner = None

    # -- calls ----------------------------------------------------------------------------
    def init_cache(self, kv_layout, block_size: int) -> int:
        return self._all("init_cache", (kv_layout, block_size))[0]

    def rank0_call(self, kind: str):
        """Rank 0's answer to a stats request ("spec_snapshot", "expert_load", ...); every
        rank handles it (resets reach all), the others' answers are dropped."""
        return self._all(kind, None)[0]

    def call_all(self, kind: str, payload) -> list:
        """Every rank's answer to one request (a change all ranks must make together)."""
        return self._all(kind, payload)

    def execute(self, so):
        self._send_all("execute", so)
        return step_result([self._reply(rank) for rank in range(self.world_size)])

    def release(self, req_ids) -> None:
        self._send_all("release", sorted(req_ids))

    def memory(self) -> list[dict]:
        return self._all("memory", None)

    def check_alive(self) -> None:
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                self._fail(f"tensor-parallel worker rank {rank} exited (code {proc.exitcode})")

    # -- transport ------------------------------------------------------------------------
    def _all(self, kind: str, payload) -> list:
        self._send_all(kind, payload)
        return [self._reply(rank) for rank in range(self.world_size)]

    def _send_all(self, kind: str, payload) -> None:
        if self._stopped:
            raise WorkerFailedError("the tensor-parallel workers have stopped")
        data = serial.encode((kind, payload))
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, ConnectionError, OSError):
                self._fail(f"tensor-parallel worker rank {rank} is gone")

    def _reply(self, rank: int, timeout_s: Optional[float] = None):
        """Rank ``rank``'s next reply; meanwhile any rank's death or error fails the call."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._pending[rank]:
            ready = multiprocessing.connection.wait(self.conns, timeout=self.POLL_S)
            for conn in ready:   # every rank's replies are read as they come: errors first
                r = self.conns.index(conn)
                status, value = self._read(r)
                if status == "error":
                    self._fail(value)
                self._pending[r].append(value)
            if not self._pending[rank]:
                self.check_alive()
            if deadline is not None and time.monotonic() > deadline:
                self._fail(f"tensor-parallel worker rank {rank} did not answer in {timeout_s:.0f} s")
        return self._pending[rank].pop(0)

    def _read(self, rank: int):
        try:
            return serial.decode(self.conns[rank].recv_bytes())
        except (EOFError, ConnectionError, OSError):
            proc = self.procs[rank]
            proc.join(1.0)
            self._fail(f"tensor-parallel worker rank {rank} exited (code {proc.exitcode})")

    def _fail(self, message: str):
        logger.error("%s; stopping every rank", message)
        self.shutdown()
        raise WorkerFailedError(message)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop every rank and reap it: no child process outlives the executor."""
        if self._stopped:
            return
        self._stopped = True
        for conn in self.conns:
            try:
                conn.send_bytes(serial.encode(("stop", None)))
            except Exception:
                pass
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for conn in self.conns:
            conn.close()


def make_executor(spec: RankSpec, parallel, num_threads: int, checkpoint=None):
    """The executor for ``parallel.tensor_parallel_size`` ranks. ``checkpoint``: the engine's
    open checkpoint, which an in-process rank loads from instead of opening it again."""
    if parallel.tensor_parallel_size == 1:
        return InProcessExecutor(spec, checkpoint)
    if parallel.distributed_executor_backend == "ray":
        from tokenmill.runner.ray_executor import RayExecutor
        return RayExecutor(spec, parallel, num_threads)
    return MultiprocExecutor(spec, parallel.tensor_parallel_size, num_threads)
