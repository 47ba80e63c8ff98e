"""Helpers for data-parallel tests: engine configs on the tiny model, child processes, runs."""
from __future__ import annotations

import multiprocessing
import os
import time

from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig


def tiny_config(model_dir: str, dp: int = 1, num_threads=1, **parallel) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=model_dir, skip_tokenizer_init=True),
                        cache=CacheConfig(block_size=16, num_kv_blocks=64),
                        num_threads=num_threads,
                        parallel=ParallelConfig(data_parallel_size=dp, **parallel))


def child_pids() -> set[int]:
    """Every live descendant of this process (psutil if installed, else /proc)."""
    try:
        import psutil
    except ImportError:
        return _proc_descendants(os.getpid())
    return {p.pid for p in psutil.Process().children(recursive=True)
            if p.status() != psutil.STATUS_ZOMBIE}


def _proc_descendants(root: int) -> set[int]:
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(name)] = int(fields[1])
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def settle_children(baseline: set[int], timeout: float = 10.0) -> set[int]:
    """Children beyond ``baseline`` once they had ``timeout`` seconds to go away."""
    deadline = time.monotonic() + timeout
    while True:
        extra = child_pids() - baseline
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.1)


def start_resource_tracker() -> None:
    """multiprocessing's resource tracker is a child for the life of the process; start it
    before a baseline is taken so it is not counted as a leak."""
    from multiprocessing import resource_tracker
    resource_tracker.ensure_running()
    assert multiprocessing.active_children() == []


def run_to_completion(engine, requests: dict, timeout: float = 60.0) -> dict:
    """Add ``{request_id: (prompt_ids, params)}`` and step until all finish; the final
    RequestOutput per id."""
    for request_id, (ids, params) in requests.items():
        engine.add_request(request_id, {"prompt_token_ids": ids}, params)
    return drain(engine, timeout)


def drain(engine, timeout: float = 60.0) -> dict:
    finished = {}
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests did not finish in time"
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished
