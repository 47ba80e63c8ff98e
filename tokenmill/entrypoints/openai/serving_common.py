"""What /v1/completions and /v1/chat/completions share: model check, SamplingParams from a
request (with its one output constraint), starting requests all-or-nothing, merging their
streams, waiting with disconnect detection, usage and logprob formatting, SSE framing."""
from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Optional, Sequence

from fastapi import Request

from tokenmill.engine.async_engine import (AsyncEngine, EngineDeadError, EngineNotReadyError,
                                           EngineOverloadedError, RequestFailedError,
                                           RequestHandle)
from tokenmill.entrypoints.openai.errors import (OpenAIError, bad_request, error_body,
                                                 from_value_error)
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.entrypoints.openai.protocol import SamplingFields
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.params import StructuredOutputsParams

# Names a ValueError message may start with, to set the error's ``param``.
PARAM_NAMES = ("n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
               "stop", "stop_token_ids", "logit_bias", "logprobs", "presence_penalty",
               "frequency_penalty", "repetition_penalty", "prompt_logprobs", "prompt", "messages",
               "cache_salt", "structured_outputs", "dimensions")
# vLLM's older top-level spellings of structured_outputs, and the field each one sets.
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
_STRUCTURED_PREFIX = re.compile(r"^structured_outputs\.[a-z_]+:")
_MIN_LOGPROB = -9999.0   # JSON has no -inf; clients get a very unlikely finite value instead


class ClientDisconnected(Exception):
    """The HTTP client went away before its non-streamed answer was ready."""


@dataclass(frozen=True)
class OutputConstraint:
    """The one grammar a request's output must follow, and the request field that asked for
    it (the ``param`` of a 400 when it does not compile)."""

    params: StructuredOutputsParams
    field: str


def output_constraint(req: SamplingFields,
                      route_fields: Sequence[tuple[str, Optional[dict]]] = ()
                      ) -> Optional[OutputConstraint]:
    """The constraint of ``structured_outputs``, ``guided_*`` and the route's own fields
    (``route_fields``: (field, StructuredOutputsParams fields or None)); at most one may be set,
    since two grammars cannot both hold."""
    given = [("structured_outputs", req.structured_outputs)]
    given += [(name, {kind: getattr(req, name)}) for name, kind in _GUIDED_FIELDS.items()
              if getattr(req, name) is not None]
    given = [(name, fields) for name, fields in [*given, *route_fields] if fields is not None]
    if len(given) > 1:
        raise bad_request(f"{given[0][0]} and {given[1][0]} both constrain the output; "
                          "set only one of them", given[1][0])
    if not given:
        return None
    field, fields = given[0]
    try:
        return OutputConstraint(StructuredOutputsParams.from_dict(fields), field)
    except (ValueError, TypeError) as e:
        raise bad_request(str(e), field) from None


def response_format_fields(value: Optional[dict]) -> Optional[dict]:
    """StructuredOutputsParams fields of OpenAI's ``response_format`` (None: plain text)."""
    kind = None if value is None else value.get("type")
    if value is None or kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise bad_request('response_format.type must be "text", "json_object" or "json_schema"',
                          "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request('response_format.json_schema is required with type "json_schema"',
                          "response_format")
    if not isinstance(spec.get("name"), str) or not 1 <= len(spec["name"]) <= 64:
        raise bad_request("response_format.json_schema.name must be a string of 1 to 64 "
                          "characters", "response_format")
    if not isinstance(spec.get("schema"), dict):
        raise bad_request("response_format.json_schema.schema must be a JSON schema (an object)",
                          "response_format")
    return {"json": spec["schema"]}   # strict or not, the grammar holds the output to it


class ServingBase:
    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics

    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name != self.model_name:
            raise OpenAIError(404, f"the model {name!r} does not exist; this server serves "
                                   f"{self.model_name!r}", "model", "model_not_found")

    def sampling_params(self, req: SamplingFields, max_tokens: Optional[int],
                        logprobs: Optional[int], default_max_tokens: Optional[int],
                        renames: Optional[dict] = None,
                        prompt_logprobs: Optional[int] = None,
                        constraint: Optional[OutputConstraint] = None) -> SamplingParams:
        """``prompt_logprobs``: the engine's, when the route needs more than the request's
        (completions' echo with logprobs)."""
        if req.prompt_logprobs is not None and req.stream:   # as vLLM: whole response only
            raise bad_request("prompt_logprobs are not available with stream=true",
                              "prompt_logprobs")
        if prompt_logprobs is None:
            prompt_logprobs = req.prompt_logprobs
        kwargs = dict(n=req.n, max_tokens=max_tokens or default_max_tokens,
                      min_tokens=req.min_tokens, seed=req.seed, stop=req.stop,
                      stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                      logit_bias=req.logit_bias, logprobs=logprobs,
                      prompt_logprobs=prompt_logprobs,
                      skip_special_tokens=req.skip_special_tokens,
                      include_stop_str_in_output=req.include_stop_str_in_output)
        optional = dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                        min_p=req.min_p, presence_penalty=req.presence_penalty,
                        frequency_penalty=req.frequency_penalty,
                        repetition_penalty=req.repetition_penalty)
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        if constraint is not None:
            kwargs["structured_outputs"] = constraint.params
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            raise from_value_error(e, PARAM_NAMES, renames=renames) from None

    def check_accepting(self) -> None:
        try:
            self.engine.check_accepting()
        except RuntimeError as e:
            raise self._map_start_error(e, "prompt") from None

    async def start(self, prompts: Sequence, params: SamplingParams, base_id: str,
                    req: SamplingFields, prompt_param: str,
                    constraint_param: Optional[str] = None) -> list[RequestHandle]:
        """Queue every prompt or none: a bad prompt aborts the ones already queued.
        ``constraint_param``: the field a grammar that does not compile is blamed on."""
        handles: list[RequestHandle] = []
        try:
            for i, prompt in enumerate(prompts):
                request_id = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                handles.append(await self.engine.add(request_id, prompt, params, req.priority,
                                                     req.cache_salt))
        except BaseException as e:
            for h in handles:
                h.close()
            raise self._map_start_error(e, prompt_param, constraint_param) from None
        return handles

    @staticmethod
    def _map_start_error(e: BaseException, prompt_param: str,
                         constraint_param: Optional[str] = None) -> BaseException:
        if isinstance(e, EngineOverloadedError):
            return OpenAIError(503, str(e), None, "server_overloaded", {"Retry-After": "1"})
        if isinstance(e, (EngineNotReadyError, EngineDeadError)):
            return OpenAIError(503, str(e), None, "service_unavailable", {"Retry-After": "5"})
        if isinstance(e, ValueError) and constraint_param and _STRUCTURED_PREFIX.match(str(e)):
            # The engine names the grammar "structured_outputs.<kind>"; the client may have
            # written response_format or tools, so the message names the field it sent.
            message = str(e)
            if constraint_param != "structured_outputs":
                message = _STRUCTURED_PREFIX.sub(f"{constraint_param}:", message, count=1)
            return bad_request(message, constraint_param)
        if isinstance(e, ValueError):
            return from_value_error(e, PARAM_NAMES, default=prompt_param,
                                    renames={"prompt": prompt_param})
        return e

    def finish(self, handles: list[RequestHandle], finals: list[Optional[RequestOutput]]) -> None:
        for handle, out in zip(handles, finals):
            handle.close()
            # one per sample, also when the request ended before any output (an abort)
            reasons = [c.finish_reason for c in out.outputs] if out is not None \
                else ["abort"] * handle.num_samples
            self.metrics.on_request_done(handle, reasons)

    async def collect(self, request: Request,
                      handles: list[RequestHandle]) -> list[RequestOutput]:
        """Final output of every handle; a client disconnect aborts them all at once."""
        finals: list[Optional[RequestOutput]] = [None] * len(handles)

        async def run():
            async for i, out in merge(handles):
                finals[i] = out

        work = asyncio.ensure_future(run())
        watcher = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                work.cancel()
                raise ClientDisconnected()
            work.result()
            return finals
        except (RequestFailedError, EngineDeadError) as e:
            raise OpenAIError(500, str(e), None, "engine_error") from None
        finally:
            watcher.cancel()
            self.finish(handles, finals)


async def wait_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message can only be the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def merge(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come: yields (handle index, output).
    Only one pending read per handle, so nothing piles up behind a slow consumer."""
    iters = [h.__aiter__() for h in handles]
    pending = {asyncio.ensure_future(it.__anext__()): i for i, it in enumerate(iters)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                yield i, out
                pending[asyncio.ensure_future(iters[i].__anext__())] = i
    finally:
        for task in pending:
            task.cancel()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(finals: Sequence[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def stop_reason(value) -> object:
    return value if isinstance(value, (str, int)) else None


def safe_logprob(value: float) -> float:
    return value if value == value and value > _MIN_LOGPROB else _MIN_LOGPROB


def prompt_logprobs_json(out: RequestOutput, k: int) -> Optional[list]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token (nothing scores it), then
    per position {token_id: {"logprob", "rank", "decoded_token"}} for the prompt token and
    the ``k`` most likely ones (the engine may have kept more: echo asks for its own k)."""
    if out.prompt_logprobs is None:
        return None
    positions = []
    for token_id, entry in zip(out.prompt_token_ids, out.prompt_logprobs):
        if entry is None:
            positions.append(None)
            continue
        positions.append({t: {"logprob": safe_logprob(lp.logprob), "rank": lp.rank,
                              "decoded_token": lp.decoded_token}
                          for t, lp in entry.items()
                          if t == token_id or (lp.rank is not None and lp.rank <= k)})
    return positions


def top_entries(entry: dict, k: int) -> list:
    """The k most likely (token_id, Logprob) of a position, by rank."""
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1e9)
    return ranked[:k]


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(e: BaseException) -> str:
    if isinstance(e, OpenAIError):
        return sse(error_body(e.status, e.message, e.param, e.code))
    return sse(error_body(500, str(e) if isinstance(e, (RequestFailedError, EngineDeadError))
                          else "internal server error", None, "engine_error"))


class DeltaTracker:
    """What one choice has already streamed, so each chunk carries only what is new."""

    def __init__(self) -> None:
        self.num_chars = 0
        self.num_tokens = 0
        self.finished = False

    def take(self, c) -> Optional[tuple[str, list, Optional[str]]]:
        """(new text, new logprob entries as (token_id, entry), finish_reason once), or None
        when there is nothing new to send for this choice."""
        if self.finished:
            return None
        text = c.text[self.num_chars:]
        new_ids = c.token_ids[self.num_tokens:]
        entries = []
        if c.logprobs is not None:
            entries = list(zip(new_ids, c.logprobs[self.num_tokens:len(c.token_ids)]))
        self.num_chars, self.num_tokens = len(c.text), len(c.token_ids)
        reason = c.finish_reason
        self.finished = reason is not None
        if not text and not entries and reason is None:
            return None
        return text, entries, reason
