"""`tokenmill serve`: the OpenAI-compatible server on uvicorn, with a draining SIGTERM.

The model loads in the engine thread after the socket is open, so `/health` answers 503
("loading") instead of the connection being refused while weights are read.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from typing import Optional

import uvicorn

logger = logging.getLogger("tokenmill.server")
# After the drain deadline ended the last requests: how long their handlers get to send the
# error event (one engine step, then a write) before the sockets close.
END_GRACE_S = 2.0

# Flags users type from vLLM habits for features tokenmill does not have yet. Each is accepted
# and, when given a non-default value, stops the server with a clear message (never ignored).
_NOT_YET: dict = {}   # --tensor-parallel-size left it: a real engine flag now


def _has_option(parser: argparse.ArgumentParser, flag: str) -> bool:
    return flag in parser._option_string_actions


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    from tokenmill.entrypoints.cli import _add_engine_args
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None,
                   help="model name clients send (default: --model)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route except /health")
    g.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests waiting beyond --max-num-seqs before new ones get 503")
    g.add_argument("--max-request-body-bytes", type=int, default=8 * 1024 * 1024,
                   help="larger request bodies get 413")
    g.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds SIGTERM waits for in-flight requests; those still running "
                        "then end with an error (SSE error event, or a 500) and the server "
                        "exits 0 a few seconds later")
    g.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")
    g.add_argument("--disable-web-ui", action="store_true",
                   help="don't serve the playground (/) and the dashboard (/dashboard)")
    g.add_argument("--pooling-type", default="mean", choices=["mean", "last"],
                   help="how /v1/embeddings pools the final hidden states when a request "
                        "does not say (its 'pooling' field)")
    _add_not_yet_args(p)
    p.set_defaults(func=cmd_serve)
    return p


def _add_not_yet_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("not implemented yet (accepted; a non-default value exits)")
    specs = {
        "--tensor-parallel-size": dict(type=int, default=1),
    }
    for flag, kwargs in specs.items():
        if not _has_option(p, flag):   # another module may already own the flag
            g.add_argument(flag, **kwargs)


def unimplemented_flags(args) -> list[str]:
    """Flags given a value this build cannot honour."""
    bad = []
    for attr, (flag, default) in _NOT_YET.items():
        value = getattr(args, attr, default)
        if value is not None and value != default:
            bad.append(f"{flag} {value}")
    return bad


def _check_args(args) -> Optional[str]:
    bad = unimplemented_flags(args)
    if bad:
        return ("not implemented yet in tokenmill: " + ", ".join(bad) +
                " (drop the flag to serve without it)")
    from tokenmill.entrypoints.cli import _json_arg
    try:
        _json_arg("--speculative-config", args.speculative_config)
    except ValueError as e:
        return str(e)
    if args.max_queued_requests < 0:
        return "--max-queued-requests must be >= 0"
    if args.max_request_body_bytes < 1024:
        return "--max-request-body-bytes must be at least 1024"
    return None


def cmd_serve(args) -> int:
    problem = _check_args(args)
    if problem:
        print(f"tokenmill serve: error: {problem}", file=sys.stderr)
        return 2
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.entrypoints.openai.server import build_app

    # Logging is set up by the CLI's main() (tokenmill's loggers at --log-level).
    engine = AsyncEngine(lambda: _build_engine(args),
                         max_pending=args.max_num_seqs + args.max_queued_requests)
    app = build_app(engine, args.served_model_name or args.model, args.api_key,
                    args.max_request_body_bytes, web_ui=not args.disable_web_ui,
                    pooling_type=args.pooling_type)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.access_log, timeout_graceful_shutdown=5)
    server = DrainingServer(config, app.state.server, args.drain_timeout)
    engine.start()
    try:
        server.run()
    finally:
        engine.stop()
    if engine.load_error:
        print(f"tokenmill serve: error: {engine.load_error}", file=sys.stderr)
        return 1
    return 0


def _build_engine(args):
    """Runs in the engine thread, after the socket is open (fetch, load, both reported)."""
    from tokenmill.entrypoints.cli import load_llm
    return load_llm(args, "tokenmill.server").engine


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM drains: new requests get 503 (the gate sees
    ``draining``), in-flight ones finish, then the server exits with status 0. Requests still
    running at the drain deadline are ended with an error each client can read, and the
    server exits 0 (it stopped as asked) within END_GRACE_S more, plus uvicorn's own
    ``timeout_graceful_shutdown`` for a client that stopped reading. A second signal (or
    Ctrl-C) exits the usual way. Once it listens and the model has loaded, it logs the URL it
    answers at (``announced``)."""

    def __init__(self, config, state, drain_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self._drain_deadline: Optional[float] = None
        self._cut_at: Optional[float] = None   # when the deadline ended the last requests
        self.announced = False

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGTERM and not self.state.draining:
            # Not recorded as a captured signal: uvicorn would re-raise it after shutdown,
            # killing the process with -15 instead of exiting 0.
            self.state.draining = True
            self._drain_deadline = time.monotonic() + self.drain_timeout
            logger.info("SIGTERM: draining %d in-flight requests (at most %g s)",
                        self.state.num_inflight, self.drain_timeout)
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        # uvicorn ticks every 0.1 s once its sockets listen, so the first tick after the
        # engine thread finished loading is the moment requests can be answered.
        if not self.announced and self.started and self.state.engine.healthy:
            self.announced = True
            self._announce()
        if self.state.draining and not self.should_exit:
            self.should_exit = self._drained()
        return await super().on_tick(counter)

    def _announce(self) -> None:
        logger.info(f"serving {self.state.model_name} at {self.url} (OpenAI API under /v1)")
        if self.state.web_ui:
            logger.info(f"web playground at {self.url}/ and engine dashboard at "
                        f"{self.url}/dashboard")

    def _drained(self) -> bool:
        """Whether the drain is over: nothing in flight, or the deadline has passed, the
        requests still running were ended, and their handlers had END_GRACE_S to send the
        error. Left to uvicorn's shutdown instead, a streamed answer would stop mid-chunk
        and a non-streamed one get a bare text 500 once its task is cancelled."""
        if self.state.num_inflight == 0:
            return True
        now = time.monotonic()
        if now < self._drain_deadline:
            return False
        if self._cut_at is None:
            self._cut_at = now
            logger.warning("drain deadline of %g s passed with %d requests in flight: ending "
                           "them with an error", self.drain_timeout, self.state.num_inflight)
        # Every tick, not once: a request that was between the gate and the engine at the
        # deadline (e.g. compiling its grammar) is caught by the next call.
        self.state.engine.end_requests(f"the server shut down before this request finished "
                                       f"(drain deadline of {self.drain_timeout:g} s)")
        return now > self._cut_at + END_GRACE_S

    @property
    def url(self) -> str:
        """http://host:port, with the port the socket really got (``--port 0`` picks one)."""
        port = self.config.port
        for server in getattr(self, "servers", ()):   # set by startup()
            for sock in server.sockets:
                port = sock.getsockname()[1]
        host = self.config.host
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
