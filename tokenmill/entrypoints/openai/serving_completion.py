"""POST /v1/completions: one or several prompts (text or token ids), n samples each.

``echo`` returns prompt + completion (streamed: the prompt comes in each choice's first
chunk); with ``logprobs`` the prompt tokens are scored too, the first one with a null
logprob and null top_logprobs (nothing comes before it), as OpenAI does. ``echo`` with
``max_tokens`` 0 scores the prompt without generating: like vLLM, the engine samples one
token, which the response drops."""
from __future__ import annotations

from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.engine.async_engine import RequestHandle
from tokenmill.entrypoints.openai.errors import bad_request
from tokenmill.entrypoints.openai.protocol import CompletionRequest
from tokenmill.entrypoints.openai.serving_common import (SSE_DONE, ClientDisconnected,
                                                         DeltaTracker, ServingBase, merge,
                                                         new_id, now, output_constraint,
                                                         response_format_fields, safe_logprob, sse,
                                                         prompt_logprobs_json, sse_error,
                                                         stop_reason, top_entries, usage)

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


def completion_logprobs(entries: list, k: int, offset: int, decode=None) -> dict:
    """entries: (token_id, {token_id: Logprob} or None). A None entry (the prompt's first
    token, which nothing scores) gets null logprob and top_logprobs, its text from
    ``decode(token_id)``."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, entry in entries:
        if entry is None:
            text = decode(token_id) if decode is not None else ""
            token_logprobs.append(None)
            tops.append(None)
        else:
            lp = entry[token_id]
            text = lp.decoded_token or ""
            token_logprobs.append(safe_logprob(lp.logprob))
            tops.append({(e.decoded_token or ""): safe_logprob(e.logprob)
                         for _, e in top_entries(entry, k)})
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


class CompletionServing(ServingBase):
    async def create(self, req: CompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        self._check_unsupported(req)
        prompts = normalize_prompts(req.prompt)
        constraint = output_constraint(
            req, [("response_format", response_format_fields(req.response_format))])
        params = self.sampling_params(req, 1 if _echo_only(req) else req.max_tokens,
                                      req.logprobs, _DEFAULT_MAX_TOKENS,
                                      prompt_logprobs=_engine_prompt_logprobs(req),
                                      constraint=constraint)
        request_id = new_id("cmpl")
        handles = await self.start(prompts, params, request_id, req, "prompt",
                                   constraint.field if constraint else None)
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
        if req.max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens must be at least 1 (0 only with echo=true, to score "
                              "the prompt)", "max_tokens")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of must equal n (no server-side ranking)", "best_of")

    def _response(self, req: CompletionRequest, finals: list, request_id: str) -> dict:
        choices = []
        for i, out in enumerate(finals):
            echo = self._echo(req, out)
            for c in out.outputs:
                token_ids, entries = self._generated(req, c)
                lps = None
                if req.logprobs is not None:
                    lps = completion_logprobs(echo[1] + list(zip(token_ids, entries)),
                                              req.logprobs, 0, self._decode)
                choice = {"index": i * req.n + c.index,
                          "text": echo[0] + ("" if _echo_only(req) else c.text),
                          "logprobs": lps, "finish_reason": c.finish_reason,
                          "stop_reason": stop_reason(c.stop_reason)}
                if req.prompt_logprobs is not None:   # vLLM: per choice on this route
                    choice["prompt_logprobs"] = prompt_logprobs_json(out, req.prompt_logprobs)
                choices.append(choice)
        return {"id": request_id, "object": "text_completion", "created": now(),
                "model": self.model_name, "choices": choices,
                "usage": _usage(req, finals)}

    @staticmethod
    def _generated(req: CompletionRequest, c) -> tuple[list, list]:
        """(token ids, logprob entries) of a choice's completion; none when only echoing."""
        if _echo_only(req):
            return [], []
        return c.token_ids, c.logprobs or []

    def _echo(self, req: CompletionRequest, out) -> tuple[str, list]:
        """(prompt text, prompt logprob entries as (token_id, entry or None)) that lead each
        choice of ``out`` when echoing; ("", []) otherwise."""
        if not req.echo:
            return "", []
        text = out.prompt if out.prompt is not None else self._decode_all(out.prompt_token_ids)
        entries = []
        if req.logprobs is not None:
            scored = out.prompt_logprobs or []
            entries = [(t, scored[p] if p < len(scored) else None)
                       for p, t in enumerate(out.prompt_token_ids)]
        return text, entries

    def _decode(self, token_id: int) -> str:
        return self._decode_all([token_id])

    def _decode_all(self, token_ids: list[int]) -> str:
        tokenizer = self.engine.tokenizer
        return tokenizer.decode(token_ids, skip_special_tokens=False) if tokenizer else ""

    async def _stream(self, req: CompletionRequest, handles: list[RequestHandle],
                      request_id: str):
        finals: list[Optional[object]] = [None] * len(handles)
        trackers: dict[int, DeltaTracker] = {}
        echoed: dict[int, int] = {}   # choice -> length of its echoed prompt, once sent
        created = now()
        try:
            async for i, out in merge(handles):
                finals[i] = out
                for c in out.outputs:
                    index = i * req.n + c.index
                    tracker = trackers.setdefault(index, DeltaTracker())
                    chunk = self._stream_choice(req, out, c, index, tracker, echoed)
                    if chunk is not None:
                        yield sse({"id": request_id, "object": "text_completion",
                                   "created": created, "model": self.model_name,
                                   "choices": [chunk]})
            if req.stream_options and req.stream_options.include_usage:
                yield sse({"id": request_id, "object": "text_completion", "created": created,
                           "model": self.model_name, "choices": [],
                           "usage": _usage(req, finals)})
            yield SSE_DONE
        except Exception as e:   # failure after the headers went out: an SSE error event
            yield sse_error(e)
            yield SSE_DONE
        finally:
            self.finish(handles, finals)

    def _stream_choice(self, req: CompletionRequest, out, c, index: int,
                       tracker: DeltaTracker, echoed: dict) -> Optional[dict]:
        """The next chunk of one choice, or None when it has nothing new. Its first chunk
        leads with the echoed prompt (by then the prompt is computed and scored)."""
        offset = tracker.num_chars
        delta = tracker.take(c)
        if delta is None:
            return None
        text, entries, reason = delta
        if _echo_only(req):
            text, entries = "", []
        if index not in echoed:
            echo_text, echo_entries = self._echo(req, out)
            echoed[index] = len(echo_text)
            text, entries = echo_text + text, echo_entries + entries
        else:
            offset += echoed[index]
        lps = (completion_logprobs(entries, req.logprobs, offset, self._decode)
               if req.logprobs is not None else None)
        return {"index": index, "text": text, "logprobs": lps, "finish_reason": reason,
                "stop_reason": stop_reason(c.stop_reason) if reason else None}


def _echo_only(req: CompletionRequest) -> bool:
    return req.echo and req.max_tokens == 0


def _engine_prompt_logprobs(req: CompletionRequest) -> Optional[int]:
    """Echo with logprobs scores the prompt; ``prompt_logprobs`` may ask for more top ones."""
    if req.echo and req.logprobs is not None:
        return max(req.logprobs, req.prompt_logprobs or 0)
    return None


def _usage(req: CompletionRequest, finals: list) -> dict:
    counts = usage(finals)
    if _echo_only(req):   # the one token sampled to finish the request is not returned
        counts["completion_tokens"] = 0
        counts["total_tokens"] = counts["prompt_tokens"]
    return counts
