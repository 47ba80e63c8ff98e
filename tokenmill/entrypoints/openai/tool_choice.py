"""What a chat request's ``tools`` and ``tool_choice`` mean: which tools the prompt shows, which
grammar (if any) forces a call, and which parser reads calls back out of the text.

- "none": the tools are shown (the conversation may refer to them) but nothing is parsed.
- "auto" (the default with tools): the template renders the tools; the parser of the call
  format the template teaches reads the output.
- "required" / a named function: a grammar forces the call, as vLLM does. That works with
  any template, because the output's shape is ours, not the template's: the named function's
  arguments, or a JSON array of ``{"name", "parameters"}``.

A template that ignores ``tools`` (SmolLM2's plain ChatML, say) cannot show them, so the
Hermes instructions go into the system prompt instead and the Hermes parser reads the output:
"auto" works with every model, if only as well as the model follows instructions.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional

from tokenmill.entrypoints.openai.errors import bad_request
from tokenmill.entrypoints.openai.mistral_tools import MistralToolParser, mistral_call_id
from tokenmill.entrypoints.openai.tool_parsers import (ContentParser, HermesToolParser,
                                                       Llama3JsonToolParser, NamedCallParser,
                                                       RequiredCallsParser, new_call_id,
                                                       template_tool_format)

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
            "mistral": MistralToolParser}

# Qwen2.5's wording of the Hermes format: what Hermes-trained models have seen most.
_HERMES_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


@dataclass(frozen=True)
class ToolPlan:
    """One request's tools, validated, and how they are shown, forced and parsed."""

    tools: tuple = ()
    choice: str = "none"                   # none | auto | required | function
    function_name: Optional[str] = None    # the function a "function" choice names
    parallel: bool = True                  # False: at most one call (parallel_tool_calls)
    template_format: Optional[str] = None  # what template_tool_format said; None: not shown

    def template_tools(self) -> Optional[list]:
        """The ``tools`` variable of a chat template that renders tools itself."""
        return list(self.tools) if self.tools and self.template_format is not None else None

    def system_prompt(self) -> Optional[str]:
        """Hermes instructions for a template that ignores tools (none: no call is wanted)."""
        if not self.tools or self.template_format is not None or self.choice == "none":
            return None
        listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in self.tools)
        return _HERMES_INSTRUCTIONS.format(tools=listed)

    def structured_outputs(self) -> Optional[dict]:
        """StructuredOutputsParams fields of the grammar that forces the call, if any."""
        if self.choice == "function":
            return {"json": _parameters(self._function(self.function_name))}
        if self.choice != "required":
            return None
        # The wrapper's shape is ours, so it allows no other keys; the parameters are the
        # user's schema, as given.
        calls = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                 "parameters": _parameters(tool["function"])},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for tool in self.tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return {"json": schema}

    def keeps_special_tokens(self) -> bool:
        """Whether the output must be decoded with special tokens: Mistral's call markers are."""
        return self.choice == "auto" and self.template_format == "mistral"

    def new_parser(self) -> ContentParser:
        # Mistral's template rejects ids of other shapes when a client sends ours back.
        call_id = mistral_call_id if self.template_format == "mistral" else new_call_id
        if self.choice == "function":
            return NamedCallParser(self.function_name, call_id)
        if self.choice == "required":
            return RequiredCallsParser(call_id)
        if self.choice == "auto":
            return _PARSERS.get(self.template_format or "hermes", ContentParser)(call_id)
        return ContentParser(call_id)

    def _function(self, name: str) -> dict:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)


def plan_tools(tools: Optional[list], tool_choice, parallel_tool_calls: Optional[bool],
               chat_template: str) -> ToolPlan:
    """Validate ``tools`` / ``tool_choice`` (400 naming the field) and plan for them."""
    checked = tuple(_check_tool(i, tool) for i, tool in enumerate(tools or ()))
    names = [tool["function"]["name"] for tool in checked]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise bad_request(f"tools: the function name {duplicate!r} is used twice", "tools")
    choice, function_name = _check_choice(tool_choice, names)
    return ToolPlan(tools=checked, choice=choice, function_name=function_name,
                    parallel=parallel_tool_calls is not False,
                    template_format=template_tool_format(chat_template))


def _check_tool(index: int, tool) -> dict:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad_request(f'{where}.type must be "function"', "tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{where}.function must be an object", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(f"{where}.function.name must match ^[a-zA-Z0-9_-]{{1,64}}$, "
                          f"got {name!r}", "tools")
    if not isinstance(function.get("description", ""), (str, type(None))):
        raise bad_request(f"{where}.function.description must be a string", "tools")
    parameters = function.get("parameters")
    if parameters is not None and (not isinstance(parameters, dict)
                                   or parameters.get("type", "object") != "object"):
        raise bad_request(f'{where}.function.parameters must be a JSON schema of type "object"',
                          "tools")
    return {"type": "function", "function": function}


def _check_choice(tool_choice, names: list[str]) -> tuple[str, Optional[str]]:
    if tool_choice is None:
        return ("auto" if names else "none"), None
    if tool_choice in ("none", "auto"):
        return (tool_choice if names else "none"), None
    if tool_choice == "required" and names:
        return "required", None
    if tool_choice == "required":
        raise bad_request('tool_choice "required" needs tools', "tool_choice")
    name = _named_function(tool_choice)
    if name not in names:
        raise bad_request(f"tool_choice names the function {name!r}, which is not in tools",
                          "tool_choice")
    return "function", name


def _named_function(tool_choice) -> str:
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (not isinstance(tool_choice, dict) or tool_choice.get("type") != "function"
            or not isinstance(function, dict) or not isinstance(function.get("name"), str)):
        raise bad_request('tool_choice must be "none", "auto", "required" or '
                          '{"type": "function", "function": {"name": ...}}', "tool_choice")
    return function["name"]


def _parameters(function: dict) -> dict:
    return function.get("parameters") or _EMPTY_PARAMETERS
