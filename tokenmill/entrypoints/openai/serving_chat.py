"""POST /v1/chat/completions. The prompt is the model's own chat template (sandboxed Jinja in
tokenmill.tokenizer) rendered over the messages; a template is never taken from a request."""
from __future__ import annotations

import asyncio
from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.engine.async_engine import RequestHandle
from tokenmill.entrypoints.openai.errors import bad_request
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from tokenmill.entrypoints.openai.serving_common import (SSE_DONE, ClientDisconnected,
                                                         DeltaTracker, ServingBase, new_id, now,
                                                         safe_logprob, sse, sse_error,
                                                         stop_reason, top_entries, usage)

# The template may not know the newer "developer" role; it means what "system" meant.
_ROLE_ALIASES = {"developer": "system"}


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    return [{"role": _ROLE_ALIASES.get(m.role, m.role), "content": m.text()} for m in messages]


def _token_info(token_id: int, lp) -> dict:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": safe_logprob(lp.logprob), "bytes": list(text.encode())}


def chat_logprobs(entries: list, k: int) -> dict:
    content = []
    for token_id, entry in entries:
        info = _token_info(token_id, entry[token_id])
        info["top_logprobs"] = [_token_info(t, e) for t, e in top_entries(entry, k)]
        content.append(info)
    return {"content": content}


async def render_chat(engine, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
    """Token ids of the rendered conversation (in a worker thread: big prompts take time)."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise bad_request("this model was loaded without a tokenizer; use /v1/completions "
                          "with token ids", "messages")
    try:
        return await asyncio.to_thread(tokenizer.apply_chat_template, message_dicts(messages),
                                       add_generation_prompt=add_generation_prompt, tokenize=True)
    except ValueError as e:
        raise bad_request(str(e), "messages") from None


class ChatServing(ServingBase):
    async def create(self, req: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        self._check_unsupported(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, req.max_completion_tokens or req.max_tokens,
                                      num_logprobs, None, renames={"logprobs": "top_logprobs"})
        self.check_accepting()   # before spending time on the template
        prompt_ids = await render_chat(self.engine, req.messages, req.add_generation_prompt)
        request_id = new_id("chatcmpl")
        handles = await self.start([{"prompt_token_ids": prompt_ids}], params, request_id, req,
                                   "messages")
        if req.stream:
            return StreamingResponse(self._stream(req, handles[0], request_id),
                                     media_type="text/event-stream")
        try:
            finals = await self.collect(request, handles)
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(self._response(req, finals[0], request_id))

    @staticmethod
    def _check_unsupported(req: ChatCompletionRequest) -> None:
        if req.tools and req.tool_choice != "none":
            raise bad_request("tool calling is not supported", "tools")

    def _response(self, req: ChatCompletionRequest, out, request_id: str) -> dict:
        choices = []
        for c in out.outputs:
            lps = None
            if req.logprobs:
                lps = chat_logprobs(list(zip(c.token_ids, c.logprobs or [])), req.top_logprobs or 0)
            choices.append({"index": c.index,
                            "message": {"role": "assistant", "content": c.text},
                            "logprobs": lps, "finish_reason": c.finish_reason,
                            "stop_reason": stop_reason(c.stop_reason)})
        return {"id": request_id, "object": "chat.completion", "created": now(),
                "model": self.model_name, "choices": choices, "usage": usage([out])}

    def _chunk(self, request_id: str, created: int, choices: list, **extra) -> str:
        return sse({"id": request_id, "object": "chat.completion.chunk", "created": created,
                    "model": self.model_name, "choices": choices, **extra})

    async def _stream(self, req: ChatCompletionRequest, handle: RequestHandle, request_id: str):
        final: Optional[object] = None
        created = now()
        trackers = [DeltaTracker() for _ in range(req.n)]
        try:
            # The role comes first, alone, as OpenAI sends it.
            yield self._chunk(request_id, created, [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(req.n)])
            async for out in handle:
                final = out
                for c in out.outputs:
                    delta = trackers[c.index].take(c)
                    if delta is None:
                        continue
                    text, entries, reason = delta
                    lps = chat_logprobs(entries, req.top_logprobs or 0) if req.logprobs else None
                    yield self._chunk(request_id, created, [
                        {"index": c.index, "delta": {"content": text} if text else {},
                         "logprobs": lps, "finish_reason": reason,
                         "stop_reason": stop_reason(c.stop_reason) if reason else None}])
            if req.stream_options and req.stream_options.include_usage:
                yield self._chunk(request_id, created, [], usage=usage([final]))
            yield SSE_DONE
        except Exception as e:   # failure after the headers went out: an SSE error event
            yield sse_error(e)
            yield SSE_DONE
        finally:
            self.finish([handle], [final])
