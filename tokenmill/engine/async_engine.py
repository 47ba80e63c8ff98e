"""AsyncEngine: one LLMEngine stepping in its own thread, streaming outputs to asyncio.

The LLMEngine is synchronous and not thread-safe, so exactly one thread (the *engine thread*)
builds it and ever touches it. HTTP handlers talk to it through a command queue (add, abort,
stop) and get outputs back through the event loop with ``call_soon_threadsafe``.

A RequestOutput is cumulative (full text, token ids and logprobs so far), so a reader only
ever needs the latest one: each stream keeps a single slot instead of a queue, which bounds
the memory a slow client can pin to one output per request.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from typing import AsyncIterator, Callable, Optional, Union

from tokenmill.engine.snapshot import EngineSnapshot, SnapshotCursor, snapshot_counters
from tokenmill.outputs import EmbeddingRequestOutput, RequestOutput, failure_reasons
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "EngineSnapshot", "RequestHandle", "EngineDeadError",
           "EngineNotReadyError", "EngineOverloadedError", "RequestFailedError"]

logger = logging.getLogger("tokenmill.async_engine")
LONG_TEXT_CHARS = 8192   # text prompts longer than this are tokenized outside the engine thread


class EngineNotReadyError(RuntimeError):
    """The model is still loading (or failed to load)."""


class EngineDeadError(RuntimeError):
    """A step raised: the engine state can no longer be trusted; every request fails."""


class EngineOverloadedError(RuntimeError):
    """More requests are pending than the queue limit allows; the client should retry."""


class RequestFailedError(RuntimeError):
    """One request finished with an error (e.g. NaN logits) while the engine is fine."""


class _Stream:
    """The asyncio side of one request: latest output + wake-up event (loop thread only)."""

    def __init__(self) -> None:
        self.latest: Optional[RequestOutput] = None
        self.error: Optional[BaseException] = None
        self.event = asyncio.Event()

    def deliver(self, out: Optional[RequestOutput], error: Optional[BaseException]) -> None:
        if out is not None:
            self.latest = out
        if error is not None:
            self.error = error
        self.event.set()


class AsyncEngine:
    """``build`` is called in the engine thread and returns an LLMEngine or a
    DataParallelEngine (anything with their synchronous surface; see
    tokenmill.engine.data_parallel.create_engine).

    ``max_pending`` bounds requests accepted but not finished (running + queued); beyond it
    ``add`` raises EngineOverloadedError so the server can answer 503.
    """

    def __init__(self, build: Callable[[], object], max_pending: Optional[int] = None) -> None:
        self._build = build
        self.max_pending = max_pending
        self.engine = None                      # touched only in the engine thread
        self.load_error: Optional[str] = None
        self.dead_error: Optional[str] = None
        self.ready = threading.Event()
        self.num_pending = 0                    # event-loop side count of live requests
        self.stats_listeners: list[Callable[[EngineSnapshot], None]] = []
        # Filled once loaded; read-only afterwards, so any thread may use them.
        self.tokenizer = None
        self.max_model_len: Optional[int] = None
        self.compile_grammar: Optional[Callable] = None   # the engine's (thread-safe) compiler
        self._commands: "queue.SimpleQueue" = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, _Stream]] = {}
        self._thread: Optional[threading.Thread] = None
        self._cursor = SnapshotCursor()   # per-request samples already published

    # -- lifecycle (any thread) ---------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._commands.put(("stop",))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_ready(self) -> bool:
        return self.ready.is_set() and self.load_error is None

    @property
    def healthy(self) -> bool:
        return self.is_ready and self.dead_error is None

    def end_requests(self, message: str) -> None:
        """End every request in flight with RequestFailedError(message) (each client reads
        an error; their KV blocks return) while the engine keeps running: the server's drain
        deadline. Any thread; it happens in the engine thread."""
        self.call(lambda engine: self._end_streams(RequestFailedError(message)))

    def call(self, fn: Callable) -> concurrent.futures.Future:
        """Run ``fn(engine)`` in the engine thread (for introspection in tests and tools)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, fut))
        return fut

    # -- requests (event-loop thread) ---------------------------------------------------------
    async def add(self, request_id: str, prompt, params: Union[SamplingParams, PoolingParams],
                  priority: int = 0, cache_salt: Optional[str] = None) -> "RequestHandle":
        """Queue a request; bad input raises ValueError here, before any output. The caller
        must ``close()`` the handle (it aborts the request if it has not finished).
        PoolingParams make a prompt-only request whose one output is an
        EmbeddingRequestOutput."""
        self.check_accepting()
        if isinstance(prompt, str) and len(prompt) > LONG_TEXT_CHARS and self.tokenizer is not None:
            # Encoded here, in a worker thread: in the engine thread a megabyte of text would
            # stop every running request for the second its encoding takes.
            ids = await asyncio.to_thread(self.tokenizer.encode, prompt)
            prompt = {"prompt": prompt, "prompt_token_ids": ids}
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            # Compiled here, in a worker thread, so one slow schema never stalls the engine
            # loop; the engine then finds it in the compile cache.
            await asyncio.to_thread(self.compile_grammar, params.structured_outputs)
        loop = asyncio.get_running_loop()
        handle = RequestHandle(self, request_id, getattr(params, "n", 1))
        added: concurrent.futures.Future = concurrent.futures.Future()
        self.num_pending += 1
        self._commands.put(("add", request_id, prompt, params, priority, cache_salt,
                            (loop, handle.stream), added))
        try:
            await asyncio.wrap_future(added)
        except BaseException:
            handle.close()
            raise
        return handle

    async def generate(self, request_id: str, prompt, params: SamplingParams, priority: int = 0,
                       cache_salt: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's growing RequestOutput until it finishes; leaving early aborts."""
        handle = await self.add(request_id, prompt, params, priority, cache_salt)
        try:
            async for out in handle:
                yield out
        finally:
            handle.close()

    def check_accepting(self) -> None:
        if not self.ready.is_set():
            raise EngineNotReadyError("the model is still loading")
        if self.load_error is not None:
            raise EngineNotReadyError(f"the model failed to load: {self.load_error}")
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        if self.max_pending is not None and self.num_pending >= self.max_pending:
            raise EngineOverloadedError(
                f"the server is at capacity ({self.num_pending} requests pending); retry later")

    # -- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = self._build()
            self.tokenizer = self.engine.tokenizer
            self.max_model_len = self.engine.max_model_len
            self.compile_grammar = self.engine.processor.compile_grammar
        except Exception as e:  # reported by /health; the server stays up to say so
            logger.exception("model load failed")
            self.load_error = f"{type(e).__name__}: {e}"
        finally:
            self.ready.set()
        if self.load_error is None:
            try:
                self._loop()
            finally:
                self._close_engine()

    def _close_engine(self) -> None:
        # A data-parallel engine owns replica processes / actors: stop them with the server.
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:
                logger.exception("engine shutdown failed")

    def _loop(self) -> None:
        while True:
            # A dead engine never steps again: wait for commands instead of spinning.
            idle = self.dead_error is not None or not self.engine.has_unfinished_requests()
            if not self._run_commands(block=idle):
                return
            if self.dead_error is None and self.engine.has_unfinished_requests():
                self._step()

    def _run_commands(self, block: bool) -> bool:
        """Run queued commands (waiting for one if ``block``); False once told to stop."""
        while True:
            try:
                cmd = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            kind = cmd[0]
            if kind == "stop":
                return False
            if kind == "add":
                self._add(*cmd[1:])
            elif kind == "abort":
                self._abort(cmd[1])
            elif kind == "call":
                self._call(*cmd[1:])

    def _add(self, request_id, prompt, params, priority, cache_salt, target, fut) -> None:
        if self.dead_error is not None:
            fut.set_exception(EngineDeadError(self.dead_error))
            return
        try:
            self.engine.add_request(request_id, prompt, params, priority=priority,
                                    cache_salt=cache_salt)
        except Exception as e:  # ValueError = bad input; anything else is reported as is
            fut.set_exception(e)
            return
        self._streams[request_id] = target
        fut.set_result(request_id)

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None and self.dead_error is None:
            self.engine.abort_request(request_id)
            self._publish_stats()

    def _call(self, fn, fut) -> None:
        # A caller that gave up (a closed dashboard stream cancels its asyncio wrapper, which
        # cancels this future) gets nothing; setting a result on a cancelled future would
        # raise here and kill the engine thread.
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(self.engine))
        except Exception as e:
            fut.set_exception(e)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._fail_all(e)
            return
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is None:
                continue
            error = None
            if out.finished:
                del self._streams[out.request_id]
                reasons = failure_reasons(out)
                if reasons:
                    error = RequestFailedError(reasons[0] or "the request failed inside the model")
            loop, stream = target
            loop.call_soon_threadsafe(stream.deliver, out, error)
        if not getattr(self.engine, "healthy", True):   # a data-parallel replica died
            self._fail_all(None, self.engine.dead_error)
        self._publish_stats()

    def _fail_all(self, exc: Optional[BaseException], reason: Optional[str] = None) -> None:
        # The traceback goes to the server log only; clients get a generic message.
        if exc is not None:
            logger.error("engine step failed; failing all requests", exc_info=exc)
            reason = f"the engine failed ({type(exc).__name__})"
        else:
            logger.error("engine unhealthy (%s); failing all requests", reason)
        self.dead_error = f"{reason}; the server must be restarted"
        self._end_streams(EngineDeadError(self.dead_error))

    def _end_streams(self, error: BaseException) -> None:
        for request_id, (loop, stream) in list(self._streams.items()):
            loop.call_soon_threadsafe(stream.deliver, None, error)
            try:
                self.engine.abort_request(request_id)
            except Exception:  # after a failure the state may be broken: best effort
                logger.exception("abort of %s failed", request_id)
        self._streams.clear()

    def _publish_stats(self) -> None:
        if not self.stats_listeners:
            return
        snap = self._snapshot()
        for listener in self.stats_listeners:
            listener(snap)

    def _snapshot(self) -> EngineSnapshot:
        own = getattr(self.engine, "snapshot_counters", None)   # DataParallelEngine
        if own is not None:
            return own()
        return snapshot_counters(self.engine, self._cursor)


class RequestHandle:
    """One accepted request, seen from the event loop: iterate for outputs, then close().

    Also records when outputs arrived (time to first token, gaps between tokens) so the
    server can report latency as its clients see it."""

    def __init__(self, engine: AsyncEngine, request_id: str, num_samples: int = 1) -> None:
        self.engine = engine
        self.request_id = request_id
        self.num_samples = num_samples   # n: sequences it ends with
        self.stream = _Stream()
        self.arrival_time = time.monotonic()
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        self.inter_token_latencies: list[float] = []   # seconds per token, per delivery
        self._num_tokens = 0
        self._closed = False

    @property
    def finished(self) -> bool:
        return self.stream.latest is not None and self.stream.latest.finished

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        stream = self.stream
        while True:
            await stream.event.wait()
            stream.event.clear()
            if stream.error is not None:
                raise stream.error
            out = stream.latest
            self._record_timing(out)
            yield out
            if out.finished:
                return

    def _record_timing(self, out: RequestOutput) -> None:
        if isinstance(out, EmbeddingRequestOutput):
            return   # generates no tokens: no time to first token, no gaps
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        new = num_tokens - self._num_tokens
        if new <= 0:
            return
        now = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            self.inter_token_latencies.append((now - self.last_token_time) / new)
        self.last_token_time = now
        self._num_tokens = num_tokens

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.engine.num_pending -= 1
        if not self.finished:   # client left early or the request failed: free its blocks
            self.engine._commands.put(("abort", self.request_id))
