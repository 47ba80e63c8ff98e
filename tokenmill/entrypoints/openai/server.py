"""The OpenAI-compatible FastAPI app: routes plus one gate in front of them all (API key,
body size, draining), so no route can forget a check."""
from __future__ import annotations

import asyncio
import hmac
from dataclasses import dataclass
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

import tokenmill
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.entrypoints import web
from tokenmill.entrypoints.openai.errors import bad_request, error_body, install_handlers
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                   DetokenizeRequest, EmbeddingRequest,
                                                   TokenizeRequest)
from tokenmill.entrypoints.openai.serving_chat import ChatServing, render_chat
from tokenmill.entrypoints.openai.serving_completion import CompletionServing
from tokenmill.entrypoints.openai.serving_embedding import EmbeddingServing

# Routes that answer without the API key (a load balancer's probe has no key). The web
# pages and their static files are open too when the web UI is on: they hold no data, and
# ask the user for the key, which they then send as a bearer header on every API call.
AUTH_ALLOW_LIST = frozenset({"/health"})
WEB_ALLOW_LIST = frozenset(web.PAGES) | {"/web/config"}
WEB_STATIC_PREFIX = "/static/"


def open_without_key(path: str, web_ui: bool) -> bool:
    """Whether ``path`` answers without the API key."""
    return path in AUTH_ALLOW_LIST or (web_ui and (path in WEB_ALLOW_LIST
                                                   or path.startswith(WEB_STATIC_PREFIX)))
# Routes that still answer while draining, so operators can watch the drain.
DRAIN_ALLOW_LIST = frozenset({"/health", "/metrics"})
_BODY_METHODS = {"POST", "PUT", "PATCH"}


@dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str
    metrics: ServerMetrics
    api_key: Optional[str] = None
    max_body_bytes: int = 8 * 1024 * 1024
    web_ui: bool = True             # the playground and dashboard pages
    pooling_type: str = "mean"      # /v1/embeddings' default ("mean" | "last")
    draining: bool = False
    num_inflight: int = 0           # HTTP requests being served, outside the allow lists


class GateMiddleware:
    """Plain ASGI middleware (not BaseHTTPMiddleware, which would buffer streams)."""

    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, state = scope["path"], self.state
        headers = dict(scope.get("headers") or [])
        if (state.api_key and not open_without_key(path, state.web_ui)
                and not self._authorized(headers)):
            return await self._reply(send, 401, "a valid API key is required "
                                                "(Authorization: Bearer <key>)")
        if state.draining and path not in DRAIN_ALLOW_LIST:
            return await self._reply(send, 503, "the server is shutting down",
                                     [(b"retry-after", b"5")], code="server_shutting_down")
        if scope.get("method") in _BODY_METHODS:
            body = await self._read_body(receive, headers)
            if body is None:
                return await self._reply(send, 413, f"request body is larger than "
                                                    f"{state.max_body_bytes} bytes")
            receive = _replay(body, receive)
        counted = path not in DRAIN_ALLOW_LIST
        state.num_inflight += counted
        try:
            await self.app(scope, receive, self._counting_send(send))
        finally:
            state.num_inflight -= counted

    def _authorized(self, headers: dict) -> bool:
        value = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = value.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), self.state.api_key.encode())

    async def _read_body(self, receive, headers: dict) -> Optional[bytes]:
        """The whole body, or None once it passes the limit (the Content-Length is not
        trusted alone: chunked uploads have none)."""
        limit = self.state.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    def _counting_send(self, send):
        async def wrapped(message):
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.state.metrics.on_error(message["status"])
            await send(message)
        return wrapped

    async def _reply(self, send, status: int, message: str, extra_headers=(),
                     code: Optional[str] = None) -> None:
        self.state.metrics.on_error(status)
        await JSONResponse(error_body(status, message, code=code), status_code=status,
                           headers={k.decode(): v.decode() for k, v in extra_headers})(
            {"type": "http"}, _no_receive, send)


async def _no_receive():
    return {"type": "http.disconnect"}


def _replay(body: bytes, receive):
    """A receive() that hands the buffered body once, then defers to the real one (whose
    next message is the client's disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


def build_app(engine: AsyncEngine, model_name: str, api_key: Optional[str] = None,
              max_body_bytes: int = 8 * 1024 * 1024, web_ui: bool = True,
              pooling_type: str = "mean") -> FastAPI:
    """``web_ui``: serve the playground (/) and the dashboard (/dashboard); the engine stream
    and per-request stats under /v1/engine answer either way (behind the key).
    ``pooling_type``: how /v1/embeddings pools when a request does not say."""
    metrics = ServerMetrics(model_name)
    engine.stats_listeners.append(metrics.on_engine_snapshot)
    state = ServerState(engine, model_name, metrics, api_key, max_body_bytes, web_ui,
                        pooling_type=pooling_type)
    app = FastAPI(title="tokenmill", version=tokenmill.__version__, docs_url=None,
                  redoc_url=None)
    app.state.server = state
    install_handlers(app)
    _add_routes(app, state)
    _add_engine_routes(app, state)
    if web_ui:
        _add_web_routes(app, state)
    app.add_middleware(GateMiddleware, state=state)
    return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
    completions = CompletionServing(state.engine, state.model_name, state.metrics)
    chat = ChatServing(state.engine, state.model_name, state.metrics)
    embeddings = EmbeddingServing(state.engine, state.model_name, state.metrics,
                                  state.pooling_type)
    errors = {400: {"description": "invalid request"}}

    @app.post("/v1/completions", responses=errors)
    async def create_completion(body: CompletionRequest, request: Request):
        return await completions.create(body, request)

    @app.post("/v1/chat/completions", responses=errors)
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        return await chat.create(body, request)

    @app.post("/v1/embeddings", responses=errors)
    async def create_embedding(body: EmbeddingRequest, request: Request):
        return await embeddings.create(body, request)

    @app.get("/v1/models")
    async def list_models():
        card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "tokenmill",
                "max_model_len": state.engine.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        eng = state.engine
        if state.draining or not eng.healthy:
            reason = ("draining" if state.draining else eng.dead_error or eng.load_error
                      or "loading")
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version():
        return {"version": tokenmill.__version__}

    @app.post("/tokenize", responses=errors)
    async def tokenize(body: TokenizeRequest):
        tokenizer = _ready_tokenizer(completions, body.model)
        if body.messages is not None:
            ids = await render_chat(state.engine, body.messages, body.add_generation_prompt)
        elif body.prompt is not None:
            ids = await asyncio.to_thread(tokenizer.encode, body.prompt, body.add_special_tokens)
        else:
            raise bad_request("give either prompt or messages", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": state.engine.max_model_len}

    @app.post("/detokenize", responses=errors)
    async def detokenize(body: DetokenizeRequest):
        tokenizer = _ready_tokenizer(completions, body.model)
        if any(t >= tokenizer.vocab_size for t in body.tokens):
            raise bad_request(f"token ids must be below the vocabulary size "
                              f"{tokenizer.vocab_size}", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}


def _add_engine_routes(app: FastAPI, state: ServerState) -> None:
    """The engine's live state (the dashboard's source) and one request's speculative
    figures (the playground's), both behind the key like every API route."""

    @app.get("/v1/engine/stream")
    async def engine_stream():
        return StreamingResponse(web.DashboardFeed(state).events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/v1/engine/requests/{request_id}")
    async def request_stats(request_id: str):
        if not state.engine.healthy:
            return JSONResponse(error_body(503, "the model is not loaded"), status_code=503)
        def read(eng):
            return eng.config.speculative is not None, web.request_spec_stats(eng, request_id)
        speculating, spec = await asyncio.wrap_future(state.engine.call(read))
        if speculating and spec is None:
            return JSONResponse(error_body(404, f"no recent request {request_id!r}"), status_code=404)
        return {"request_id": request_id, "spec_decode": spec}


def _add_web_routes(app: FastAPI, state: ServerState) -> None:
    def page(name: str) -> Response:
        found = web.static_file(name)
        if found is None:
            return JSONResponse(error_body(404, "not found"), status_code=404)
        return Response(found[0], media_type=found[1], headers=web.SECURITY_HEADERS)

    for path, name in web.PAGES.items():
        app.add_api_route(path, lambda name=name: page(name), methods=["GET"],
                          include_in_schema=False)

    @app.get(WEB_STATIC_PREFIX + "{name}", include_in_schema=False)
    async def static(name: str):
        return page(name)

    @app.get("/web/config", include_in_schema=False)
    async def web_config():
        return {"auth_required": bool(state.api_key), "version": tokenmill.__version__}


def _ready_tokenizer(serving: CompletionServing, model: Optional[str]):
    serving.check_model(model)
    serving.check_accepting()
    if serving.engine.tokenizer is None:
        raise bad_request("this model was loaded without a tokenizer", "model")
    return serving.engine.tokenizer
