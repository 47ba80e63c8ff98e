"""Request bodies of the OpenAI API (pydantic), with the bounds a client can be told about.

Bounds checked here produce a 400 whose ``param`` is the field's name; whatever is only known
once the model is loaded (vocabulary, max_model_len) is checked by the engine and mapped by
errors.from_value_error. Unknown fields are ignored, as vLLM does, so clients that send extra
OpenAI fields keep working.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

_INT64 = 2**63 - 1
Finite = Annotated[float, Field(allow_inf_nan=False)]
Temperature = Annotated[float, Field(ge=0.0, le=100.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=-_INT64 - 1, le=_INT64)]
MaxTokens = Annotated[int, Field(ge=1, le=_INT64)]
TopLogprobs = Annotated[int, Field(ge=0, le=20)]
TokenId = Annotated[int, Field(ge=0, le=_INT64)]
_SURROGATE = re.compile("[\ud800-\udfff]")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _lone_surrogate(value: Any) -> Optional[str]:
    """The first lone surrogate in raw JSON data, or None. Lists that start with a number
    (token ids) are skipped: a string inside one fails their type check anyway."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found = _SURROGATE.search(item)
            if found:
                return found.group()
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list) and item and not isinstance(item[0], (int, float)):
            stack.extend(item)
    return None


class _Request(_Body):
    """A whole request. JSON can spell a lone surrogate ("\\ud800"), which no UTF-8 text
    holds: the tokenizer cannot encode it and no response could echo it back, so every field
    is checked here and the client gets a 400 naming the field."""

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        found = _lone_surrogate(value)
        if found is not None:
            raise PydanticCustomError("unicode", "holds a lone surrogate U+{code}; text must be "
                                      "valid Unicode", {"code": f"{ord(found):04X}"})
        return value


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions (vLLM extras included)."""

    model: Optional[str] = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    max_tokens: Optional[MaxTokens] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    top_k: Optional[Annotated[int, Field(ge=-1, le=1_000_000)]] = None
    min_p: Optional[Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]] = None
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    repetition_penalty: Optional[Annotated[float, Field(gt=0.0, le=100.0, allow_inf_nan=False)]] = None
    seed: Optional[Seed] = None
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[TokenId]] = None
    min_tokens: Annotated[int, Field(ge=0, le=_INT64)] = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Optional[dict[str, Finite]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] = 0
    cache_salt: Optional[Annotated[str, Field(min_length=1, max_length=256)]] = None
    # vLLM extra: logprobs of the prompt tokens (top k), in the non-streamed response
    prompt_logprobs: Optional[TopLogprobs] = None
    # vLLM extra: the grammar the output must follow, StructuredOutputsParams' fields
    # (checked there, so its messages reach the client); guided_* are vLLM's older spellings.
    structured_outputs: Optional[dict] = None
    guided_json: Union[None, str, dict] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None


PromptInput = Union[str, list[str], list[TokenId], list[list[TokenId]]]


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    # 0 only with echo: score the prompt without generating (checked by the route)
    max_tokens: Optional[Annotated[int, Field(ge=0, le=_INT64)]] = None
    logprobs: Optional[TopLogprobs] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[Annotated[int, Field(ge=1, le=128)]] = None
    response_format: Optional[dict] = None   # as in chat (vLLM accepts it here too)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: Union[str, dict] = "{}"   # OpenAI sends a JSON string; some clients a dict


class ToolCall(_Body):
    """A call the assistant made earlier in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None for an assistant message that only calls tools
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None   # assistant messages
    tool_call_id: Optional[str] = None            # tool messages: the call they answer

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Optional[MaxTokens] = None
    logprobs: bool = False
    top_logprobs: Optional[TopLogprobs] = None
    add_generation_prompt: bool = True
    # response_format, tools and tool_choice are checked by the route (serving_chat,
    # tool_choice), so that every mistake in them is a 400 naming the top-level field.
    response_format: Optional[dict] = None
    tools: Optional[list[dict]] = None
    tool_choice: Union[None, str, dict] = None
    parallel_tool_calls: Optional[bool] = None   # False: at most one call


class TokenizeRequest(_Request):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[Annotated[list[ChatMessage], Field(min_length=1)]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: Optional[str] = None
    tokens: list[TokenId]


class EmbeddingRequest(_Request):
    """POST /v1/embeddings (OpenAI's fields; ``pooling`` and ``normalize`` are vLLM-style
    extras; ``user`` is accepted and ignored)."""

    model: Optional[str] = None
    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[Annotated[int, Field(ge=1)]] = None
    user: Optional[str] = None
    pooling: Optional[Literal["mean", "last"]] = None     # None: the server's --pooling-type
    normalize: bool = True
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] = 0
    cache_salt: Optional[Annotated[str, Field(min_length=1, max_length=256)]] = None
