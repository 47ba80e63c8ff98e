"""POST /v1/chat/completions. The prompt is the model's own chat template (sandboxed Jinja in
tokenmill.tokenizer) rendered over the messages; a template is never taken from a request.

Tools: tool_choice.ToolPlan says how a request's tools are shown, forced and parsed; its parser
(tool_parsers) turns the output into content and tool calls, fed the same way for streamed and
whole answers. response_format and structured_outputs become the request's one grammar."""
from __future__ import annotations

import asyncio
import json
from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.engine.async_engine import RequestHandle
from tokenmill.entrypoints.openai.errors import bad_request
from tokenmill.entrypoints.openai.mistral_tools import with_mistral_ids
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from tokenmill.entrypoints.openai.serving_common import (SSE_DONE, ClientDisconnected,
                                                         DeltaTracker, OutputConstraint,
                                                         ServingBase, new_id, now,
                                                         output_constraint,
                                                         response_format_fields, safe_logprob, sse,
                                                         prompt_logprobs_json, sse_error,
                                                         stop_reason, top_entries, usage)
from tokenmill.entrypoints.openai.tool_choice import ToolPlan, plan_tools
from tokenmill.entrypoints.openai.tool_parsers import (ContentParser, assemble, merge_deltas,
                                                       template_tool_format)

# The template may not know the newer "developer" role; it means what "system" meant.
_ROLE_ALIASES = {"developer": "system"}


def message_dicts(messages: list[ChatMessage], reads_tools: bool = True) -> list[dict]:
    """The messages as the template sees them. A template that ``reads_tools`` gets tool calls
    and results the way HF templates expect them; any other sees them as Hermes text, the
    format ToolPlan teaches such a model in the system prompt."""
    dicts = [_message_dict(m) for m in messages]
    return dicts if reads_tools else _tools_as_text(dicts)


def _message_dict(m: ChatMessage) -> dict:
    # content is never None: templates concatenate it ("" is as falsy as None in their tests)
    d = {"role": _ROLE_ALIASES.get(m.role, m.role), "content": m.text()}
    if m.tool_calls:
        # HF templates write `arguments | tojson`: they want the arguments as an object.
        d["tool_calls"] = [{"id": c.id, "type": "function",
                            "function": {"name": c.function.name,
                                         "arguments": _arguments_object(c.function.arguments)}}
                           for c in m.tool_calls]
    if m.role == "tool":
        d["tool_call_id"] = m.tool_call_id
        if m.name:
            d["name"] = m.name
    return d


def _arguments_object(arguments):
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments   # not JSON: the template gets the text as it came
    return value if isinstance(value, dict) else arguments


def _tools_as_text(dicts: list[dict]) -> list[dict]:
    """Tool calls as <tool_call> blocks in the assistant's text, tool results as
    <tool_response> blocks in a user turn (consecutive results share one, as in Qwen's
    template, so templates that insist on alternating roles still render)."""
    out: list[dict] = []
    previous_role = None
    for d in dicts:
        if d["role"] == "tool":
            block = f"<tool_response>\n{d['content']}\n</tool_response>"
            if previous_role == "tool":
                block = out.pop()["content"] + "\n" + block
            out.append({"role": "user", "content": block})
        elif d.get("tool_calls"):
            calls = [_hermes_call_text(c["function"]) for c in d["tool_calls"]]
            text = "\n".join(filter(None, [d["content"], *calls]))
            out.append({"role": d["role"], "content": text})
        else:
            out.append(d)
        previous_role = d["role"]
    return out


def _hermes_call_text(function: dict) -> str:
    call = {"name": function["name"], "arguments": function["arguments"]}
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"


def _with_system_prompt(dicts: list[dict], prompt: str) -> list[dict]:
    if dicts and dicts[0]["role"] == "system":
        first = dicts[0]["content"]
        return [dict(dicts[0], content=f"{first}\n\n{prompt}" if first else prompt), *dicts[1:]]
    return [{"role": "system", "content": prompt}, *dicts]


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


def template_inputs(messages: list[ChatMessage], chat_template: str,
                    tools: ToolPlan) -> tuple[list[dict], dict]:
    """The message dicts and the extra variables (``tools``) the chat template renders."""
    call_format = template_tool_format(chat_template)
    dicts = message_dicts(messages, call_format is not None)
    if call_format == "mistral":   # its template raises on ids not of its shape
        dicts = with_mistral_ids(dicts)
    system_prompt, template_tools = tools.system_prompt(), tools.template_tools()
    if system_prompt:
        dicts = _with_system_prompt(dicts, system_prompt)
    return dicts, ({"tools": template_tools} if template_tools else {})


async def render_chat(engine, messages: list[ChatMessage], add_generation_prompt: bool,
                      tools: Optional[ToolPlan] = None) -> list[int]:
    """Token ids of the rendered conversation (in a worker thread: big prompts take time)."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise bad_request("this model was loaded without a tokenizer; use /v1/completions "
                          "with token ids", "messages")
    dicts, variables = template_inputs(messages, tokenizer.chat_template or "",
                                       tools or ToolPlan())
    try:
        return await asyncio.to_thread(tokenizer.apply_chat_template, dicts,
                                       add_generation_prompt=add_generation_prompt, tokenize=True,
                                       **variables)
    except ValueError as e:
        raise bad_request(str(e), "messages") from None


def _finish_reason(reason: Optional[str], parser: ContentParser) -> Optional[str]:
    return "tool_calls" if reason == "stop" and parser.num_calls else reason


def _blamed_field(constraint: Optional[OutputConstraint]) -> Optional[str]:
    """The field a grammar that does not compile is blamed on: a forced call's grammar is
    built from the tools' parameter schemas."""
    if constraint is None:
        return None
    return "tools" if constraint.field == "tool_choice" else constraint.field


class ChatServing(ServingBase):
    async def create(self, req: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                           self._chat_template())
        constraint = output_constraint(req, [
            ("response_format", response_format_fields(req.response_format)),
            ("tool_choice", tools.structured_outputs())])
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, req.max_completion_tokens or req.max_tokens,
                                      num_logprobs, None, renames={"logprobs": "top_logprobs"},
                                      constraint=constraint)
        if tools.keeps_special_tokens():   # the call markers are special tokens
            params = params.clone(skip_special_tokens=False)
        self.check_accepting()   # before spending time on the template
        prompt_ids = await render_chat(self.engine, req.messages, req.add_generation_prompt,
                                       tools)
        request_id = new_id("chatcmpl")
        handles = await self.start([{"prompt_token_ids": prompt_ids}], params, request_id, req,
                                   "messages", _blamed_field(constraint))
        if req.stream:
            return StreamingResponse(self._stream(req, handles[0], request_id, tools),
                                     media_type="text/event-stream")
        try:
            finals = await self.collect(request, handles)
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(self._response(req, finals[0], request_id, tools))

    def _chat_template(self) -> str:
        tokenizer = self.engine.tokenizer
        return (tokenizer.chat_template or "") if tokenizer is not None else ""

    def _response(self, req: ChatCompletionRequest, out, request_id: str,
                  tools: ToolPlan) -> dict:
        choices = []
        for c in out.outputs:
            lps = None
            if req.logprobs:
                lps = chat_logprobs(list(zip(c.token_ids, c.logprobs or [])), req.top_logprobs or 0)
            parser = tools.new_parser()
            content, calls = assemble(parser.feed(c.text) + parser.finish())
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choices.append({"index": c.index, "message": message, "logprobs": lps,
                            "finish_reason": _finish_reason(c.finish_reason, parser),
                            "stop_reason": stop_reason(c.stop_reason)})
        body = {"id": request_id, "object": "chat.completion", "created": now(),
                "model": self.model_name, "choices": choices, "usage": usage([out])}
        if req.prompt_logprobs is not None:   # vLLM: at the top level on this route
            body["prompt_logprobs"] = prompt_logprobs_json(out, req.prompt_logprobs)
        return body

    def _chunk(self, request_id: str, created: int, choices: list, **extra) -> str:
        return sse({"id": request_id, "object": "chat.completion.chunk", "created": created,
                    "model": self.model_name, "choices": choices, **extra})

    async def _stream(self, req: ChatCompletionRequest, handle: RequestHandle, request_id: str,
                      tools: ToolPlan):
        final: Optional[object] = None
        created = now()
        trackers = [DeltaTracker() for _ in range(req.n)]
        parsers = [tools.new_parser() for _ in range(req.n)]
        try:
            # The role comes first, alone, as OpenAI sends it.
            yield self._chunk(request_id, created, [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(req.n)])
            async for out in handle:
                final = out
                for c in out.outputs:
                    choice = self._stream_choice(req, c, trackers[c.index], parsers[c.index])
                    if choice is not None:
                        yield self._chunk(request_id, created, [choice])
            if req.stream_options and req.stream_options.include_usage:
                yield self._chunk(request_id, created, [], usage=usage([final]))
            yield SSE_DONE
        except Exception as e:   # failure after the headers went out: an SSE error event
            yield sse_error(e)
            yield SSE_DONE
        finally:
            self.finish([handle], [final])

    @staticmethod
    def _stream_choice(req: ChatCompletionRequest, c, tracker: DeltaTracker,
                       parser: ContentParser) -> Optional[dict]:
        """The next chunk of choice ``c``, or None when there is nothing to send yet (no new
        text, or only text the parser holds back until it knows whether it starts a call)."""
        delta = tracker.take(c)
        if delta is None:
            return None
        text, entries, reason = delta
        message = merge_deltas(parser.feed(text) + (parser.finish() if reason else []))
        if not message and not entries and reason is None:
            return None
        lps = chat_logprobs(entries, req.top_logprobs or 0) if req.logprobs else None
        reason = _finish_reason(reason, parser)
        return {"index": c.index, "delta": message, "logprobs": lps, "finish_reason": reason,
                "stop_reason": stop_reason(c.stop_reason) if reason else None}
