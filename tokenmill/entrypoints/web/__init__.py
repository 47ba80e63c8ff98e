"""The web playground (`/`) and the live engine dashboard (`/dashboard`).

The pages are static files (``static/``, shipped in the wheel, no CDN, no build step); they
hold no data, so they load without the API key, and everything they show comes through the
API with the key the user typed (sent as a bearer header, kept in the tab's sessionStorage).
The dashboard reads one server-sent-event stream, ``/v1/engine/stream``, fed from the
engine's own state: ``engine_view`` runs in the engine thread (the only thread that may
touch the engine), ``DashboardFeed`` turns its counters into rates.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from typing import AsyncIterator, Optional

from tokenmill.engine import snapshot

STATIC_DIR = os.path.join(os.path.dirname(__file__), "static")
STREAM_INTERVAL_S = 0.5   # the issue asks for at least one update a second

# Every page: scripts and styles from this origin only (no inline code), no framing, no
# plugins, fetches to this origin only.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
        "form-action 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}
_MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png"}
PAGES = {"/": "index.html", "/dashboard": "dashboard.html"}


def static_file(name: str) -> Optional[tuple[bytes, str]]:
    """(bytes, media type) of a file directly inside STATIC_DIR; None for anything else
    (sub-paths, dot files, unknown types), so a request cannot walk out of the folder."""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        return None
    media = _MEDIA_TYPES.get(os.path.splitext(name)[1])
    path = os.path.join(STATIC_DIR, name)
    if media is None or not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return f.read(), media


def engine_view(engine) -> dict:
    """The engine's state for the dashboard (run in the engine thread): queue lengths,
    cumulative token counts, prefix-cache and KV figures with a per-block map, speculative
    acceptance per draft position. A data-parallel engine merges its replicas' views (the
    block map shows every replica's pool, one after the other)."""
    own = getattr(engine, "dashboard_view", None)   # DataParallelEngine
    return own() if own is not None else snapshot.dashboard_view(engine)


def request_spec_stats(engine, request_id: str) -> Optional[dict]:
    """A recent or running request's speculative counters (engine thread); None when the
    engine does not speculate or no longer remembers the request."""
    own = getattr(engine, "request_spec_stats", None)   # DataParallelEngine
    return own(request_id) if own is not None else snapshot.request_spec_stats(engine, request_id)


class DashboardFeed:
    """One page's stream: an engine view every STREAM_INTERVAL_S with token rates since the
    previous event and the server's latency percentiles and finish counts."""

    def __init__(self, state) -> None:
        self.state = state
        self._last: Optional[tuple[float, int, int]] = None

    def event(self, view: dict) -> dict:
        now = time.monotonic()
        prompt, gen = view["prompt_tokens_total"], view["generation_tokens_total"]
        rates = (0.0, 0.0)
        if self._last is not None and now > self._last[0]:
            dt = now - self._last[0]
            rates = (max(0, prompt - self._last[1]) / dt, max(0, gen - self._last[2]) / dt)
        self._last = (now, prompt, gen)
        m = self.state.metrics
        return {"time": time.time(), "model": self.state.model_name,
                "prompt_tokens_per_s": round(rates[0], 2),
                "generation_tokens_per_s": round(rates[1], 2),
                "num_requests_finished": m.num_finished, "num_aborted": m.num_aborted,
                **m.latency_percentiles(), **view}

    async def events(self) -> AsyncIterator[str]:
        """SSE lines until the client goes away (the server then cancels this generator) or
        the server drains (an open dashboard must not hold a shutdown back)."""
        engine = self.state.engine
        while not self.state.draining:
            if engine.healthy:
                view = await asyncio.wrap_future(engine.call(engine_view))
                payload = self.event(view)
            else:
                payload = {"time": time.time(), "model": self.state.model_name,
                           "status": "loading" if not engine.is_ready else "unavailable"}
            yield f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
            await asyncio.sleep(STREAM_INTERVAL_S)
