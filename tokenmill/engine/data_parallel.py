"""Data parallelism: ``data_parallel_size`` whole-engine replicas behind LLMEngine's surface.

Each replica is a plain LLMEngine (built from the same config with data_parallel_size=1) in
a spawned process ("mp") or a Ray actor ("ray"). The parent tokenizes and validates each
request exactly as LLMEngine would (so bad input raises ValueError here), picks a replica
with the router (prefix-aware by default, on the prompt's token ids; the n samples of a
request stay together), and forwards it. Replicas step on their own and push their outputs;
``step()`` hands out what arrived, waiting briefly when nothing has.

A replica that dies fails its in-flight requests (finish_reason "error") and makes the
engine unhealthy (``healthy`` False, ``dead_error`` says why): it accepts no new requests,
and ``shutdown()`` still stops every replica, so nothing hangs or leaks.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import queue
import threading
import weakref
from collections import deque
from typing import Optional

from tokenmill.distributed import serial
from tokenmill.engine.replica import (REMOTE_ERRORS, ProcessReplicas, error_output,
                                           replica_config)
from tokenmill.distributed.router import make_router
from tokenmill.utils.moe_stats import merge_expert_loads
from tokenmill.engine import snapshot
from tokenmill.engine.processor import Processor, PromptType
from tokenmill.structured.stats import merge_counters as merge_structured
from tokenmill.outputs import RequestOutput
from tokenmill.platform import usable_cores
from tokenmill.sampling_params import SamplingParams
from tokenmill.utils import cdiv

POLL_INTERVAL_S = 0.02        # step() waits this long for a first output, then returns
STARTUP_TIMEOUT_S = 900.0     # replicas that have not loaded by then are given up on
RECENT_SAMPLES = 10_000       # per-request samples (queue times) kept between snapshots


def create_engine(config):
    """LLMEngine for one replica, DataParallelEngine for several."""
    if config.parallel.data_parallel_size == 1:
        from tokenmill.engine.llm_engine import LLMEngine
        return LLMEngine(config)
    return DataParallelEngine(config)


class ReplicaDeadError(RuntimeError):
    """The replica a call went to died before it answered."""


class _Mailbox:
    """Where replica events land (filled by a backend's reader thread). Holds no reference
    to the engine, so an engine nobody uses can be collected and its replicas stopped."""

    def __init__(self) -> None:
        self.events: "queue.SimpleQueue[tuple[int, list]]" = queue.SimpleQueue()
        self._calls: dict[int, tuple[int, concurrent.futures.Future]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()

    def expect_reply(self, index: int) -> tuple[int, concurrent.futures.Future]:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            call_id = next(self._ids)
            self._calls[call_id] = (index, fut)
        return call_id, fut

    def deliver(self, index: int, message: list) -> None:
        kind = message[0]
        if kind in ("reply", "reply_error"):
            with self._lock:
                _, fut = self._calls.pop(message[1], (None, None))
            if fut is None:
                return
            if kind == "reply":
                fut.set_result(message[2])
            else:
                fut.set_exception(REMOTE_ERRORS.get(message[2], RuntimeError)(message[3]))
            return
        if kind == "dead":
            self.fail_calls(lambda i: i == index, message[1])
        self.events.put((index, message))

    def fail_calls(self, which, reason: str) -> None:
        with self._lock:
            doomed = [cid for cid, (i, _) in self._calls.items() if which(i)]
            futures = [self._calls.pop(cid)[1] for cid in doomed]
        for fut in futures:
            fut.set_exception(ReplicaDeadError(reason))


@dataclasses.dataclass
class _InFlight:
    replica: int
    ticket: int
    prompt: Optional[str]
    prompt_token_ids: list[int]
    n: int
    latest: Optional[RequestOutput] = None


class DataParallelEngine:
    def __init__(self, config) -> None:
        from tokenmill.models.hub import resolve_model
        from tokenmill.models.loader import load_tokenizer
        self.config = config
        self.num_replicas = config.parallel.data_parallel_size
        model_path = resolve_model(config.model.model, cache_dir=config.cache_dir)  # fetch once
        self.tokenizer = None if config.model.skip_tokenizer_init else load_tokenizer(model_path)
        self._mailbox = _Mailbox()
        self._replicas = self._make_backend(config)
        self._closer = weakref.finalize(self, self._replicas.stop)
        self._alive = [True] * self.num_replicas
        self.dead_error: Optional[str] = None
        self._inflight: dict[str, _InFlight] = {}
        self._loads = [0] * self.num_replicas
        self._tickets = itertools.count(1)
        self._snapshots = [snapshot.EngineSnapshot() for _ in range(self.num_replicas)]
        self._new_queue_times: deque = deque(maxlen=RECENT_SAMPLES)
        self._new_spec_requests: deque = deque(maxlen=RECENT_SAMPLES)
        try:
            self._infos = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.max_model_len = self._infos[0]["max_model_len"]
        self.vocab_size = self._infos[0]["vocab_size"]
        self.processor = Processor(self.tokenizer, self.max_model_len, self.vocab_size)
        self.router = make_router(config.parallel.router, self.num_replicas, config.cache.block_size)

    def _make_backend(self, config):
        num = self.num_replicas
        if config.parallel.distributed_executor_backend == "ray":
            from tokenmill.engine import ray_replica
            owns_ray = ray_replica.connect(config.parallel.ray_address)
            try:
                cpus = ray_replica.cpus_per_replica(num, config.num_threads)
            except BaseException:
                if owns_ray:
                    import ray
                    ray.shutdown()
                raise
            backend = ray_replica.RayReplicas(num, self._mailbox.deliver, cpus, owns_ray)
        else:
            cpus = max(1, usable_cores() // num)
            backend = ProcessReplicas(num, self._mailbox.deliver)
        backend.start([serial.encode(replica_config(config, cpus))] * num)
        return backend

    def _wait_ready(self) -> list[dict]:
        infos: list[Optional[dict]] = [None] * self.num_replicas
        while any(info is None for info in infos):
            try:
                index, message = self._mailbox.events.get(timeout=STARTUP_TIMEOUT_S)
            except queue.Empty:
                raise RuntimeError(f"data-parallel replicas did not load within "
                                   f"{STARTUP_TIMEOUT_S:.0f} s") from None
            if message[0] == "ready":
                infos[index] = message[1]
            elif message[0] == "failed":
                raise REMOTE_ERRORS.get(message[1], RuntimeError)(
                    f"data-parallel replica {index} failed to load: {message[2]}")
            elif message[0] == "dead":
                raise RuntimeError(message[1])
        return infos

    # -- health and lifecycle -----------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self.dead_error is None

    def shutdown(self) -> None:
        """Stop every replica (idempotent); pending calls fail, nothing is left running."""
        self._mailbox.fail_calls(lambda i: True, "the engine was shut down")
        self._closer()
        self._alive = [False] * self.num_replicas
        if self.dead_error is None:
            self.dead_error = "the engine was shut down"

    close = shutdown

    def __enter__(self) -> "DataParallelEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def replica_infos(self) -> list[dict]:
        """Each replica's "ready" facts: pid, num_threads, KV blocks, (Ray) node_id."""
        return [dict(info) for info in self._infos]

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: Optional[str], prompt: PromptType, params: SamplingParams,
                    priority: int = 0, cache_salt: Optional[str] = None) -> str:
        """Validate (ValueError, nothing queued, on bad input), route and queue a request."""
        if not self.healthy:
            raise RuntimeError(self.dead_error)
        if not isinstance(params, SamplingParams):   # PoolingParams: not routed yet
            raise ValueError("embeddings (pooling requests) do not run with "
                             "data_parallel_size > 1 yet")
        request_id = request_id if request_id is not None else self.processor.next_request_id()
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError("cache_salt must be a string")
        if request_id in self._inflight:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.processor.tokenize_prompt(prompt)
        first = self.processor.make_requests(request_id, ids, params, priority, cache_salt)[0]
        self._check_fits(first.num_prompt_tokens + first.max_tokens)
        index = self.router.route(ids, self._loads, cache_salt)
        ticket = next(self._tickets)
        self._inflight[request_id] = _InFlight(index, ticket, text, ids, params.n)
        self._loads[index] += 1
        self._replicas.send(index, serial.encode(
            ["add", ticket, request_id, {"prompt_token_ids": ids, "prompt": text}, params,
             priority, cache_salt]))
        return request_id

    def _check_fits(self, num_tokens: int) -> None:
        """The scheduler's admission test, against the smallest replica pool (a request any
        replica may get must fit every one)."""
        worst_case = min(num_tokens, self.max_model_len)
        limits = [info["max_request_tokens"] for info in self._infos
                  if info["max_request_tokens"] is not None]   # None: windows only, no limit
        block_size = self._infos[0]["block_size"]
        if limits and worst_case > min(limits):
            raise ValueError(
                f"request needs up to {cdiv(worst_case, block_size)} KV blocks ({num_tokens} prompt "
                f"+ max_tokens) but the KV cache holds only {min(limits) // block_size} blocks of "
                f"{block_size} tokens; lower max_tokens or give the cache more memory")

    def abort_request(self, request_id: str) -> None:
        req = self._inflight.pop(request_id, None)
        if req is None:
            return
        self._loads[req.replica] -= 1
        self._replicas.send(req.replica, serial.encode(["abort", request_id]))

    def has_unfinished_requests(self) -> bool:
        return bool(self._inflight)

    # -- outputs ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Outputs the replicas pushed since the last call, the latest one per request; waits
        up to POLL_INTERVAL_S for the first when requests are in flight and none is there."""
        outputs: dict[str, RequestOutput] = {}
        try:
            first = self._mailbox.events.get(timeout=POLL_INTERVAL_S if self._inflight else 0.0)
        except queue.Empty:
            return []
        self._apply(*first, outputs)
        while True:
            try:
                self._apply(*self._mailbox.events.get_nowait(), outputs)
            except queue.Empty:
                return list(outputs.values())

    def _apply(self, index: int, message: list, outputs: dict) -> None:
        kind = message[0]
        if kind == "outputs" and self._alive[index]:
            for ticket, out in message[1]:
                self._take_output(ticket, out, outputs)
            self._keep_counters(index, message[2])
        elif kind == "dead" and self._alive[index]:
            self._on_replica_death(index, message[1], outputs)

    def _take_output(self, ticket: int, out: RequestOutput, outputs: dict) -> None:
        req = self._inflight.get(out.request_id)
        if req is None or req.ticket != ticket:   # aborted, or an earlier request of that id
            return
        req.latest = outputs[out.request_id] = out
        if out.finished:
            del self._inflight[out.request_id]
            self._loads[req.replica] -= 1

    def _keep_counters(self, index: int, snap: snapshot.EngineSnapshot) -> None:
        self._new_queue_times.extend(snap.new_queue_times)
        self._new_spec_requests.extend(snap.new_spec_requests)
        snap.new_queue_times, snap.new_spec_requests = (), ()
        self._snapshots[index] = snap

    def _on_replica_death(self, index: int, reason: str, outputs: dict) -> None:
        self._alive[index] = False
        if self.dead_error is None:
            self.dead_error = reason
        if hasattr(self.router, "forget_replica"):
            self.router.forget_replica(index)
        snap = self._snapshots[index]    # its cumulative counts stay in the totals
        snap.num_running = snap.num_waiting = 0
        snap.kv_cache_usage = 0.0
        for request_id, req in list(self._inflight.items()):
            if req.replica == index:
                outputs[request_id] = error_output(request_id, req.prompt, req.prompt_token_ids,
                                                   req.n, reason, req.latest)
                del self._inflight[request_id]
        self._loads[index] = 0

    # -- calls answered by every replica ------------------------------------------------------
    def _call_all(self, what: str, arg=None) -> list:
        """Ask every live replica; the answers in replica order (dead ones left out)."""
        futures = []
        for index in range(self.num_replicas):
            if self._alive[index]:
                call_id, fut = self._mailbox.expect_reply(index)
                self._replicas.send(index, serial.encode(["call", call_id, what, arg]))
                futures.append(fut)
        answers = []
        timeout = self.config.parallel.collective_timeout_s
        for fut in futures:
            try:
                answers.append(fut.result(timeout))
            except ReplicaDeadError:   # died meanwhile: step() reports it
                continue
        return answers

    def warmup(self) -> None:
        """Every replica runs LLMEngine.warmup (in parallel)."""
        if self.has_unfinished_requests():
            raise RuntimeError("warmup() runs on an idle engine only")
        self._call_all("warmup")

    def get_stats(self) -> dict:
        """Totals over the replicas (see ``aggregate_stats``) and each one under "replicas"."""
        return aggregate_stats(self._call_all("stats"), self.config.parallel.router)

    def get_memory_stats(self) -> dict:
        return aggregate_memory(self._call_all("memory"))

    def snapshot_counters(self) -> snapshot.EngineSnapshot:
        """Counters for /metrics from what replicas pushed with their outputs (no round trip);
        per-request samples are those that arrived since the previous call."""
        total = snapshot.merge_snapshots(self._snapshots)
        total.new_queue_times = tuple(self._new_queue_times)
        total.new_spec_requests = tuple(self._new_spec_requests)
        self._new_queue_times.clear()
        self._new_spec_requests.clear()
        return total

    def dashboard_view(self) -> dict:
        return snapshot.merge_dashboard_views(self._call_all("view"))

    def request_spec_stats(self, request_id: str) -> Optional[dict]:
        found = [r for r in self._call_all("spec_request", request_id) if r is not None]
        return found[0] if found else None


_SUMMED = ("num_requests", "num_prompt_tokens", "num_generated_tokens", "num_steps",
           "num_preemptions", "prefix_cache_queries", "prefix_cache_hits",
           # replicas run side by side, so their rates add up
           "throughput_tokens_per_sec")
_MEANS = ("avg_latency_ms", "avg_ttft_ms", "avg_tpot_ms", "avg_queue_time_ms")


def aggregate_stats(per_replica: list[dict], router: str) -> dict:
    """Counts summed over replicas, per-request averages weighted by each replica's
    finished requests, the prefix hit rate recomputed from the sums, flat speculative counts
    (``spec_num_*``) summed; everything else per replica under "replicas"."""
    total: dict = {key: sum(s.get(key, 0) for s in per_replica) for key in _SUMMED}
    num_requests = total["num_requests"]
    for key in _MEANS:
        total[key] = (sum(s.get(key, 0.0) * s.get("num_requests", 0) for s in per_replica)
                      / num_requests if num_requests else 0.0)
    total["prefix_cache_hit_rate"] = (total["prefix_cache_hits"] / total["prefix_cache_queries"]
                                      if total["prefix_cache_queries"] else 0.0)
    spec_keys = {k for s in per_replica for k, v in s.items()
                 if k.startswith("spec_num_") and isinstance(v, int) and not isinstance(v, bool)}
    for key in sorted(spec_keys):
        total[key] = sum(s.get(key, 0) for s in per_replica)
    structured = merge_structured([s["structured_outputs"] for s in per_replica
                                   if s.get("structured_outputs")])
    if structured is not None:
        total["structured_outputs"] = structured
    moe = merge_expert_loads([s["moe"] for s in per_replica if s.get("moe")])
    if moe is not None:
        total["moe"] = moe
    total.update(data_parallel_size=len(per_replica), router=router, replicas=per_replica)
    return total


_MEMORY_SUMMED = ("model_weights", "prepacked_weights", "kv_cache", "kv_capacity_tokens",
                  "num_free_blocks", "num_total_blocks")
_MEMORY_SHARED = ("kv_cache_dtype", "kv_cache_storage_dtype", "kv_bytes_per_token", "block_size")


def aggregate_memory(per_replica: list[dict]) -> dict:
    """Bytes and blocks summed over replicas; ``free_memory`` is the smallest any replica
    sees (replicas on one node all see that node's memory, so a sum would count it twice)."""
    if not per_replica:
        return {"replicas": []}
    total = {key: sum(m[key] for m in per_replica) for key in _MEMORY_SUMMED}
    total.update({key: per_replica[0][key] for key in _MEMORY_SHARED})
    used = total["num_total_blocks"] - total["num_free_blocks"]
    total["kv_cache_usage"] = used / total["num_total_blocks"] if total["num_total_blocks"] else 0.0
    total["kv_cache_usage_perc"] = 100.0 * total["kv_cache_usage"]
    total["free_memory"] = min(m["free_memory"] for m in per_replica)
    total["replicas"] = per_replica
    return total
