"""POST /v1/completions: one or several prompts (text or token ids), n samples each."""
from __future__ import annotations

from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.engine.async_engine import RequestHandle
from tokenmill.entrypoints.openai.errors import bad_request
from tokenmill.entrypoints.openai.protocol import CompletionRequest
from tokenmill.entrypoints.openai.serving_common import (SSE_DONE, ClientDisconnected,
                                                         DeltaTracker, ServingBase, merge,
                                                         new_id, now, safe_logprob, sse,
                                                         sse_error, stop_reason, top_entries,
                                                         usage)

_MAX_PROMPTS = 64
_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for completions


def normalize_prompts(prompt) -> list:
    """str | [str] | [int] | [[int]] -> list of engine prompts (str or token-id dict)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    if len(prompt) > _MAX_PROMPTS:
        raise bad_request(f"at most {_MAX_PROMPTS} prompts per request, got {len(prompt)}",
                          "prompt")
    return [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompt]


def completion_logprobs(entries: list, k: int, offset: int) -> dict:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, entry in entries:
        lp = entry[token_id]
        text = lp.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(safe_logprob(lp.logprob))
        tops.append({(e.decoded_token or ""): safe_logprob(e.logprob)
                     for _, e in top_entries(entry, k)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


class CompletionServing(ServingBase):
    async def create(self, req: CompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        self._check_unsupported(req)
        prompts = normalize_prompts(req.prompt)
        params = self.sampling_params(req, req.max_tokens, req.logprobs, _DEFAULT_MAX_TOKENS)
        request_id = new_id("cmpl")
        handles = await self.start(prompts, params, request_id, req, "prompt")
        if req.stream:
            return StreamingResponse(self._stream(req, handles, request_id),
                                     media_type="text/event-stream")
        try:
            finals = await self.collect(request, handles)
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(self._response(req, finals, request_id))

    @staticmethod
    def _check_unsupported(req: CompletionRequest) -> None:
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if req.echo:
            raise bad_request("echo is not supported", "echo")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of must equal n (no server-side ranking)", "best_of")

    def _response(self, req: CompletionRequest, finals: list, request_id: str) -> dict:
        choices = []
        for i, out in enumerate(finals):
            for c in out.outputs:
                lps = None
                if req.logprobs is not None:
                    lps = completion_logprobs(list(zip(c.token_ids, c.logprobs or [])),
                                              req.logprobs, 0)
                choices.append({"index": i * req.n + c.index, "text": c.text, "logprobs": lps,
                                "finish_reason": c.finish_reason,
                                "stop_reason": stop_reason(c.stop_reason)})
        return {"id": request_id, "object": "text_completion", "created": now(),
                "model": self.model_name, "choices": choices, "usage": usage(finals)}

    async def _stream(self, req: CompletionRequest, handles: list[RequestHandle],
                      request_id: str):
        finals: list[Optional[object]] = [None] * len(handles)
        trackers: dict[int, DeltaTracker] = {}
        created = now()
        try:
            async for i, out in merge(handles):
                finals[i] = out
                for c in out.outputs:
                    index = i * req.n + c.index
                    tracker = trackers.setdefault(index, DeltaTracker())
                    offset = tracker.num_chars
                    delta = tracker.take(c)
                    if delta is None:
                        continue
                    text, entries, reason = delta
                    lps = (completion_logprobs(entries, req.logprobs, offset)
                           if req.logprobs is not None else None)
                    yield sse({"id": request_id, "object": "text_completion", "created": created,
                               "model": self.model_name,
                               "choices": [{"index": index, "text": text, "logprobs": lps,
                                            "finish_reason": reason,
                                            "stop_reason": stop_reason(c.stop_reason)
                                            if reason else None}]})
            if req.stream_options and req.stream_options.include_usage:
                yield sse({"id": request_id, "object": "text_completion", "created": created,
                           "model": self.model_name, "choices": [], "usage": usage(finals)})
            yield SSE_DONE
        except Exception as e:   # failure after the headers went out: an SSE error event
            yield sse_error(e)
            yield SSE_DONE
        finally:
            self.finish(handles, finals)
