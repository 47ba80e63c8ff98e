"""One data-parallel replica: a plain LLMEngine behind a command loop.

The loop is the same under both backends (a spawned process, below; a Ray actor,
ray_replica.py). Commands arrive as msgpack messages; while the engine has work the replica
steps on its own and pushes every step's RequestOutputs, each tagged with the *ticket* of the
add that created the request (so the parent can tell a reused request id's old outputs from
the new ones), plus its counters. Messages are lists whose first item names the kind:

    parent -> replica   ["add", ticket, request_id, prompt, params, priority, cache_salt]
                        ["abort", request_id]
                        ["call", call_id, what, arg]       what: one of CALLS
                        ["stop"]
    replica -> parent   ["ready", info]  |  ["failed", error_type, message]
                        ["outputs", [[ticket, RequestOutput], ...], EngineSnapshot]
                        ["reply", call_id, value]  |  ["reply_error", call_id, error_type, message]
                        ["dead", reason]      its engine failed; the replica stops
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from typing import Callable, Optional

from tokenmill import config as config_module
from tokenmill.distributed import serial
from tokenmill.engine import snapshot
from tokenmill.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger("tokenmill.replica")

CALLS = ("stats", "memory", "warmup", "view", "spec_request")
# Errors a replica reports with their own type, so the parent raises what LLMEngine would.
REMOTE_ERRORS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}

for _cls in (config_module.ModelConfig, config_module.CacheConfig, config_module.SchedulerConfig,
             config_module.SpeculativeConfig, config_module.ParallelConfig,
             config_module.EngineConfig):
    serial.register(_cls)


def replica_config(config, num_threads: int):
    """The config one replica's LLMEngine is built from: a single replica (no nested data
    parallelism), with ``num_threads`` torch threads unless the user chose a number."""
    parallel = dataclasses.replace(config.parallel, data_parallel_size=1)
    threads = config.num_threads if config.num_threads is not None else num_threads
    return dataclasses.replace(config, parallel=parallel, num_threads=threads)


def error_output(request_id: str, prompt: Optional[str], prompt_token_ids: list[int], n: int,
                 reason: str, latest: Optional[RequestOutput] = None) -> RequestOutput:
    """The final output of a request the engine cannot finish: what it had produced so far
    (``latest``), every unfinished sample ending with finish_reason "error"."""
    if latest is None:
        latest = RequestOutput(request_id, prompt, prompt_token_ids, None,
                               [CompletionOutput(i, "", [], None, None) for i in range(n)], False)
    for completion in latest.outputs:
        if completion.finish_reason is None:
            completion.finish_reason, completion.error = "error", reason
    latest.finished = True
    return latest


class ReplicaLoop:
    """Runs commands against one engine and steps it while it has work."""

    def __init__(self, engine, send: Callable[[bytes], None]) -> None:
        self.engine = engine
        self._send = send
        self._tickets: dict[str, int] = {}        # request id -> ticket of its add
        self._cursor = snapshot.SnapshotCursor()

    def run(self, recv: Callable[[bool], Optional[bytes]]) -> None:
        """``recv(block)``: the next message, or None when none is waiting and ``block`` is
        false. Returns on "stop"; a closed channel raises out of ``recv``."""
        while True:
            message = recv(not self.engine.has_unfinished_requests())
            while message is not None:
                if not self.handle(serial.decode(message)):
                    return
                message = recv(False)
            if self.engine.has_unfinished_requests():
                self._step()

    def handle(self, message: list) -> bool:
        kind = message[0]
        if kind == "add":
            self._add(*message[1:])
        elif kind == "abort":
            self._tickets.pop(message[1], None)
            self.engine.abort_request(message[1])
            self._push([])                        # counters changed without a step
        elif kind == "call":
            self._call(*message[1:])
        elif kind == "stop":
            return False
        else:
            raise ValueError(f"unknown replica command {kind!r}")
        return True

    def _add(self, ticket: int, request_id: str, prompt, params, priority: int,
             cache_salt: Optional[str]) -> None:
        try:
            self.engine.add_request(request_id, prompt, params, priority=priority,
                                    cache_salt=cache_salt)
        except ValueError as e:   # the parent validated already; this replica's pool said no
            ids = prompt.get("prompt_token_ids", []) if isinstance(prompt, dict) else []
            text = prompt.get("prompt") if isinstance(prompt, dict) else None
            self._push([[ticket, error_output(request_id, text, ids, params.n, str(e))]])
            return
        self._tickets[request_id] = ticket

    def _call(self, call_id: int, what: str, arg) -> None:
        try:
            value = self._answer(what, arg)
        except Exception as e:
            self._send(serial.encode(["reply_error", call_id, type(e).__name__, str(e)]))
            return
        self._send(serial.encode(["reply", call_id, value]))

    def _answer(self, what: str, arg):
        engine = self.engine
        if what == "stats":
            return engine.get_stats()
        if what == "memory":
            return engine.get_memory_stats()
        if what == "warmup":
            engine.warmup()
            self._cursor = snapshot.SnapshotCursor()   # warmup starts the counters afresh
            return None
        if what == "view":
            return snapshot.dashboard_view(engine)
        if what == "spec_request":
            return snapshot.request_spec_stats(engine, arg)
        raise ValueError(f"unknown replica call {what!r}; known: {CALLS}")

    def _step(self) -> None:
        outputs = self.engine.step()
        tagged = [[self._tickets.get(out.request_id, -1), out] for out in outputs]
        for out in outputs:
            if out.finished:
                self._tickets.pop(out.request_id, None)
        self._push(tagged)

    def _push(self, tagged: list) -> None:
        counters = snapshot.snapshot_counters(self.engine, self._cursor)
        self._send(serial.encode(["outputs", tagged, counters]))


def replica_info(engine) -> dict:
    """What the parent needs to validate and route requests like the replica would, and
    where the replica runs (process id, torch threads)."""
    import torch
    memory = engine.get_memory_stats()
    return {"max_model_len": engine.max_model_len,
            "vocab_size": engine.vocab_size,   # the model's, not the tokenizer's
            "num_total_blocks": memory["num_total_blocks"], "block_size": memory["block_size"],
            "max_request_tokens": engine.scheduler.max_request_tokens(),
            "pid": os.getpid(), "num_threads": torch.get_num_threads()}


def run_replica(config_bytes: bytes, recv: Callable[[bool], Optional[bytes]],
                send: Callable[[bytes], None], where: Optional[dict] = None) -> None:
    """Build the engine, say "ready" (or "failed"), then serve commands until "stop"; an
    engine failure is reported as "dead" (the traceback stays in this replica's log).
    ``where``: backend facts added to the "ready" info (a Ray node id)."""
    from tokenmill.engine.llm_engine import LLMEngine
    try:
        engine = LLMEngine(serial.decode(config_bytes))
    except Exception as e:
        logger.exception("replica failed to load")
        send(serial.encode(["failed", type(e).__name__, str(e)]))
        return
    try:
        send(serial.encode(["ready", {**replica_info(engine), **(where or {})}]))
        ReplicaLoop(engine, send).run(recv)
    except (EOFError, BrokenPipeError):   # the parent is gone: nothing left to serve
        pass
    except Exception as e:
        logger.exception("replica engine failed")
        send(serial.encode(["dead", f"a data-parallel replica's engine failed ({type(e).__name__})"]))
    finally:
        engine.shutdown()   # its tensor-parallel workers, if any, go with it


# -- the "mp" backend: one spawned process per replica ----------------------------------------

def process_main(config_bytes: bytes, commands, events) -> None:
    """Entry point of a spawned replica process (two one-way pipes of msgpack bytes)."""
    # Ctrl-C and a SIGTERM to the whole process group (systemd's stop) are the parent's to
    # handle: it drains, then stops the replicas itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def recv(block: bool) -> Optional[bytes]:
        if not block and not commands.poll(0):
            return None
        return commands.recv_bytes()              # EOFError once the parent closed its end

    try:
        run_replica(config_bytes, recv, events.send_bytes)
    except (EOFError, BrokenPipeError):
        pass


class ProcessReplicas:
    """Replica processes (multiprocessing spawn: no fork of a process holding threads and
    torch state) and the thread that reads their events into ``deliver(index, message)``.
    A replica's exit closes its event pipe, which the reader reports as a "dead" event."""

    def __init__(self, num_replicas: int, deliver: Callable[[int, list], None]) -> None:
        self.num_replicas = num_replicas
        self._deliver = deliver
        self._processes: list = []
        self._commands: list = []
        self._events: list = []
        self._reader: Optional[threading.Thread] = None
        self._stopping = False

    def start(self, config_bytes: list[bytes]) -> None:
        ctx = multiprocessing.get_context("spawn")
        for index, cfg in enumerate(config_bytes):
            cmd_recv, cmd_send = ctx.Pipe(duplex=False)
            ev_recv, ev_send = ctx.Pipe(duplex=False)
            # Not a daemon: a replica may start tensor-parallel workers of its own.
            proc = ctx.Process(target=process_main, args=(cfg, cmd_recv, ev_send),
                               name=f"tokenmill-dp-replica-{index}", daemon=False)
            proc.start()
            cmd_recv.close()   # the child's ends: closing ours lets EOF mean "gone"
            ev_send.close()
            self._processes.append(proc)
            self._commands.append(cmd_send)
            self._events.append(ev_recv)
        self._reader = threading.Thread(target=self._read_events, name="tokenmill-dp-reader",
                                        daemon=True)
        self._reader.start()

    def send(self, index: int, message: bytes) -> None:
        try:
            self._commands[index].send_bytes(message)
        except OSError:   # the replica is gone; the reader reports it
            pass

    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    def _read_events(self) -> None:
        live = {conn: i for i, conn in enumerate(self._events)}
        while live:
            for conn in multiprocessing.connection.wait(list(live)):
                index = live[conn]
                try:
                    message = serial.decode(conn.recv_bytes())
                except (EOFError, OSError):
                    del live[conn]
                    conn.close()
                    self._on_exit(index)
                    continue
                self._deliver(index, message)

    def _on_exit(self, index: int) -> None:
        if self._stopping:
            return
        proc = self._processes[index]
        proc.join(1.0)
        self._deliver(index, ["dead", f"data-parallel replica {index} exited unexpectedly "
                                      f"(exit code {proc.exitcode})"])

    def stop(self, timeout: float = 10.0) -> None:
        """Ask every replica to stop, then terminate / kill those that do not; joins all."""
        self._stopping = True
        for index in range(len(self._processes)):
            self.send(index, serial.encode(["stop"]))
        for proc in self._processes:
            proc.join(timeout)
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        if self._reader is not None:
            self._reader.join(5.0)
        for conn in self._commands:
            conn.close()
