"""The "ray" backend of data parallelism: one Ray actor per replica, on any node of a cluster.

An actor runs the same ReplicaLoop as a replica process (tokenmill.engine.replica) in a
thread of its own. The parent hands it msgpack bytes only: ``send(seq, message)`` feeds the
loop's inbox in ``seq`` order (a threaded actor does not promise to run calls in the order
they were made), and ``poll(timeout_s)`` returns what the loop pushed, waiting up to
``timeout_s`` for something. A reader thread in the parent keeps one poll in flight per
actor; a poll that fails because the actor died becomes a "dead" event.

``ray`` is imported only here, when this backend is chosen.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Optional

from tokenmill.distributed import serial
from tokenmill.engine.replica import run_replica

logger = logging.getLogger("tokenmill.ray_replica")

POLL_TIMEOUT_S = 0.5      # how long an actor holds a poll open when it has nothing to say


class _Outbox:
    """Messages the loop pushed, taken all at once by poll()."""

    def __init__(self) -> None:
        self._items: list[bytes] = []
        self._ready = threading.Condition()

    def put(self, message: bytes) -> None:
        with self._ready:
            self._items.append(message)
            self._ready.notify_all()

    def take(self, timeout_s: float) -> list[bytes]:
        with self._ready:
            if not self._items:
                self._ready.wait(timeout_s)
            items, self._items = self._items, []
            return items


class ReplicaActor:
    """Wrapped with ``ray.remote`` at start-up (so this module imports without Ray)."""

    def __init__(self, config_bytes: bytes) -> None:
        import ray
        where = {"node_id": ray.get_runtime_context().get_node_id()}
        self._inbox: "queue.Queue[bytes]" = queue.Queue()
        self._outbox = _Outbox()
        self._held: dict[int, bytes] = {}       # arrived early, waiting for their turn
        self._next_seq = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=run_replica,
                                        args=(config_bytes, self._recv, self._outbox.put, where),
                                        name="tokenmill-replica", daemon=True)
        self._thread.start()

    def send(self, seq: int, message: bytes) -> None:
        with self._lock:
            self._held[seq] = message
            while self._next_seq in self._held:
                self._inbox.put(self._held.pop(self._next_seq))
                self._next_seq += 1

    def poll(self, timeout_s: float) -> list[bytes]:
        return self._outbox.take(timeout_s)

    def _recv(self, block: bool) -> Optional[bytes]:
        try:
            return self._inbox.get(block=block)
        except queue.Empty:
            return None


def connect(address: Optional[str]) -> bool:
    """Join (or, for ``address`` None, start) a Ray cluster unless this process already has
    one; True when this call initialised Ray (so the engine shuts it down again)."""
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend='ray' needs Ray: "
                         "pip install 'ray==2.60.0'") from None
    if ray.is_initialized():
        return False
    if address is None:   # a local cluster of this machine's cores
        ray.init(include_dashboard=False)
    else:
        ray.init(address=address)
    return True


def cpus_per_replica(num_replicas: int, num_threads: Optional[int]) -> int:
    """Ray CPUs (and torch threads) each replica gets: the user's ``num_threads``, else an
    equal share of the cluster. Refuses a cluster too small to place every replica, which
    would otherwise leave the actors pending forever."""
    import ray
    total = int(ray.cluster_resources().get("CPU", 0))
    share = num_threads if num_threads is not None else max(1, total // num_replicas)
    if share * num_replicas > total:
        raise ValueError(f"the Ray cluster has {total} CPUs but {num_replicas} data-parallel "
                         f"replicas of {share} CPUs each need {share * num_replicas}")
    return share


class RayReplicas:
    """Replica actors spread over the cluster's nodes, and the thread that polls them."""

    def __init__(self, num_replicas: int, deliver: Callable[[int, list], None],
                 num_cpus: int, owns_ray: bool) -> None:
        self.num_replicas = num_replicas
        self._deliver = deliver
        self._num_cpus = num_cpus
        self._owns_ray = owns_ray
        self._actors: list = []
        self._seq: list[int] = []
        self._reader: Optional[threading.Thread] = None
        self._stopping = threading.Event()

    def start(self, config_bytes: list[bytes]) -> None:
        import ray
        actor_class = ray.remote(concurrency_groups={"inbox": 1, "outbox": 1})(ReplicaActor)
        for cfg in config_bytes:
            # SPREAD: replicas on different nodes first (DP across nodes, TP inside one).
            self._actors.append(actor_class.options(
                num_cpus=self._num_cpus, scheduling_strategy="SPREAD",
                max_restarts=0, max_task_retries=0).remote(cfg))
            self._seq.append(0)
        self._reader = threading.Thread(target=self._read_events, name="tokenmill-dp-ray-reader",
                                        daemon=True)
        self._reader.start()

    def send(self, index: int, message: bytes) -> None:
        seq, self._seq[index] = self._seq[index], self._seq[index] + 1
        self._actors[index].send.options(concurrency_group="inbox").remote(seq, message)

    def _poll(self, index: int):
        return self._actors[index].poll.options(concurrency_group="outbox").remote(POLL_TIMEOUT_S)

    def _read_events(self) -> None:
        import ray
        pending = {self._poll(i): i for i in range(len(self._actors))}
        while pending and not self._stopping.is_set():
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            for ref in ready:
                index = pending.pop(ref)
                try:
                    messages = ray.get(ref)
                except ray.exceptions.RayError as e:
                    if not self._stopping.is_set():
                        self._deliver(index, ["dead", f"data-parallel replica {index} (Ray actor) "
                                                      f"died ({type(e).__name__})"])
                    continue
                for message in messages:
                    self._deliver(index, serial.decode(message))
                pending[self._poll(index)] = index

    def stop(self, timeout: float = 10.0) -> None:
        import ray
        self._stopping.set()
        for index in range(len(self._actors)):
            try:
                self.send(index, serial.encode(["stop"]))
            except Exception:   # the actor is gone already
                pass
        if self._reader is not None:
            self._reader.join(timeout)
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._actors = []
        if self._owns_ray:
            ray.shutdown()
