"""ToolPlan alone: validation of tools / tool_choice (400 naming the field), the grammar that
forces a call, and what the chat template is given — natively for a template that reads
``tools``, as Hermes text in the system prompt for one that does not."""
import json

import jsonschema
import pytest
import tokenizers

from tokenmill.entrypoints.openai.errors import OpenAIError
from tokenmill.entrypoints.openai.protocol import ChatMessage
from tokenmill.entrypoints.openai.mistral_tools import mistral_call_id, mistral_id_for
from tokenmill.entrypoints.openai.serving_common import response_format_fields
from tokenmill.entrypoints.openai.serving_chat import (message_dicts,
                                                      template_inputs)
from tokenmill.entrypoints.openai.tool_choice import plan_tools
from tokenmill.structured.params import StructuredOutputsParams
from tokenmill.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}   # no parameters: none needed

# SmolLM2-135M-Instruct's template (plain ChatML, no tools), as shipped in its GGUF.
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
          "Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
# The tool parts of Qwen2.5's template, abridged.
QWEN = """{%- if tools %}<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
{% endif %}{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{%- endfor %}<|im_start|>assistant
"""
HISTORY = [
    ChatMessage(role="user", content="Weather and time in Paris?"),
    ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "function": {"name": "get_time", "arguments": "{}"}}]),
    ChatMessage(role="tool", tool_call_id="call_1", content="22 C, sunny"),
    ChatMessage(role="tool", tool_call_id="call_2", content="14:05"),
]


def render(template: str, plan, messages=HISTORY) -> str:
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    dicts, variables = template_inputs(messages, template, plan)
    return Tokenizer(backend, chat_template=template).apply_chat_template(dicts, **variables)


def param_of(call) -> str:
    with pytest.raises(OpenAIError) as e:
        call()
    assert e.value.status == 400 and e.value.message
    return e.value.param


@pytest.mark.parametrize("tools,choice,param", [
    ([{"type": "retrieval"}], None, "tools"),
    ([{"type": "function"}], None, "tools"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, "tools"),
    ([{"type": "function", "function": {"name": "x" * 65}}], None, "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None,
     "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], None, "tools"),
    ([WEATHER, WEATHER], None, "tools"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], {"type": "function"}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
    (None, {"type": "function", "function": {"name": "get_weather"}}, "tool_choice"),
])
def test_bad_tools_and_tool_choice_are_400s(tools, choice, param):
    assert param_of(lambda: plan_tools(tools, choice, None, CHATML)) == param


def test_defaults_and_parsers():
    assert plan_tools(None, None, None, CHATML).choice == "none"
    assert plan_tools([], "auto", None, CHATML).choice == "none"
    plan = plan_tools([WEATHER], None, None, CHATML)
    assert plan.choice == "auto" and plan.structured_outputs() is None
    assert type(plan.new_parser()).__name__ == "HermesToolParser"   # prompted Hermes format
    assert type(plan_tools([WEATHER], "none", None, QWEN).new_parser()).__name__ == "ContentParser"


def test_named_choice_forces_that_functions_parameters():
    plan = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}},
                      None, CHATML)
    assert plan.structured_outputs() == {"json": {"type": "object", "properties": {}}}
    plan = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}},
                      None, CHATML)
    assert plan.structured_outputs() == {"json": WEATHER["function"]["parameters"]}
    StructuredOutputsParams.from_dict(plan.structured_outputs())


@pytest.mark.parametrize("parallel", [None, False])
def test_required_choice_schema_accepts_calls_and_nothing_else(parallel):
    fields = plan_tools([WEATHER, TIME], "required", parallel, CHATML).structured_outputs()
    schema = StructuredOutputsParams.from_dict(fields).json
    schema = json.loads(schema)
    one = [{"name": "get_weather", "parameters": {"city": "Rome"}}]
    jsonschema.validate(one, schema)
    two = one + [{"name": "get_time", "parameters": {}}]
    if parallel is False:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(two, schema)
    else:
        jsonschema.validate(two, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}],
                [{"name": "other", "parameters": {}}],
                [{"name": "get_time", "parameters": {}, "extra": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_template_that_reads_tools_gets_them_natively():
    text = render(QWEN, plan_tools([WEATHER], None, None, QWEN))
    assert json.dumps(WEATHER) in text
    # arguments reach the template as an object, so `tojson` writes JSON, not a quoted string
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\n22 C, sunny\n</tool_response>" in text
    assert "# Tools" not in text


def test_template_without_tools_gets_hermes_instructions_and_text():
    text = render(CHATML, plan_tools([WEATHER, TIME], None, None, CHATML))
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(WEATHER) in text and json.dumps(TIME) in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}'
            '\n</tool_call><|im_end|>') in text
    # both results in one user turn
    assert ("<|im_start|>user\n<tool_response>\n22 C, sunny\n</tool_response>\n"
            "<tool_response>\n14:05\n</tool_response><|im_end|>") in text


def test_system_message_is_extended_and_none_adds_no_instructions():
    messages = [ChatMessage(role="developer", content="Be brief."), *HISTORY[:1]]
    text = render(CHATML, plan_tools([WEATHER], "auto", None, CHATML), messages)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    text = render(CHATML, plan_tools([WEATHER], "none", None, CHATML), messages)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and "# Tools" not in text


@pytest.mark.parametrize("value,fields", [
    (None, None), ({"type": "text"}, None), ({"type": "json_object"}, {"json_object": True}),
    ({"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"},
                                             "strict": True}}, {"json": {"type": "object"}}),
])
def test_response_format_fields(value, fields):
    assert response_format_fields(value) == fields


@pytest.mark.parametrize("value", [
    {"type": "xml"}, {}, {"type": "json_schema"},
    {"type": "json_schema", "json_schema": {"name": "w"}},
    {"type": "json_schema", "json_schema": {"name": "w", "schema": "{}"}},
    {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
])
def test_bad_response_format_is_400(value):
    assert param_of(lambda: response_format_fields(value)) == "response_format"


# The tool parts of Mistral 7B v0.3's template, abridged: it raises unless ids are 9 characters.
MISTRAL = """{%- for message in messages %}
{%- if message.role == "user" %}{% if tools and loop.first %}[AVAILABLE_TOOLS] {{ tools | tojson }}\
[/AVAILABLE_TOOLS]{% endif %}[INST] {{ message.content }}[/INST]
{%- elif message.role == "assistant" and message.tool_calls %}[TOOL_CALLS] [
{%- for call in message.tool_calls %}
{%- if call.id is not defined or call.id | length != 9 %}
{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{% endif %}
{{- '{"name": "' + call.function.name + '", "arguments": ' + call.function.arguments | tojson }}
{{- ', "id": "' + call.id + '"}' }}{{ ", " if not loop.last }}{% endfor %}]</s>
{%- elif message.role == "tool" %}
{%- if message.tool_call_id is not defined or message.tool_call_id | length != 9 %}
{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{% endif %}
{{- '[TOOL_RESULTS] {"content": ' + message.content | tojson + ', "call_id": "'
    + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
{%- else %}{{ message.content }}</s>{% endif %}{% endfor %}"""


def is_mistral_id(call_id: str) -> bool:
    return len(call_id) == 9 and call_id.isascii() and call_id.isalnum()


def test_mistral_template_gets_its_parser_ids_and_special_tokens():
    plan = plan_tools([WEATHER], None, None, MISTRAL)
    assert type(plan.new_parser()).__name__ == "MistralToolParser" and plan.keeps_special_tokens()
    assert not plan_tools([WEATHER], "none", None, MISTRAL).keeps_special_tokens()
    assert not plan_tools([WEATHER], None, None, QWEN).keeps_special_tokens()
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, text in ((named, '{"city": "Rome"}'),
                         ("required", '[{"name": "get_weather", "parameters": {}}]')):
        for template, shaped in ((MISTRAL, is_mistral_id), (QWEN, lambda i: i.startswith("call_"))):
            parser = plan_tools([WEATHER], choice, None, template).new_parser()
            deltas = parser.feed(text) + parser.finish()
            assert shaped(deltas[0]["tool_calls"][0]["id"])


def test_mistral_template_renders_a_clients_own_ids_mapped_to_its_shape():
    dicts = message_dicts(HISTORY)   # as they came: the template refuses "call_1"
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    with pytest.raises(ValueError, match="length 9"):
        Tokenizer(backend, chat_template=MISTRAL).apply_chat_template(dicts)
    text = render(MISTRAL, plan_tools([WEATHER], None, None, MISTRAL))
    first, second = mistral_id_for("call_1"), mistral_id_for("call_2")
    assert is_mistral_id(first) and is_mistral_id(second) and first != second
    assert mistral_id_for("call_1") == first   # stable: a call and its result still match
    assert (f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {{"city": "Paris"}}, '
            f'"id": "{first}"}}, {{"name": "get_time", "arguments": {{}}, "id": "{second}"}}]'
            ) in text
    assert f'[TOOL_RESULTS] {{"content": "22 C, sunny", "call_id": "{first}"}}' in text
    assert "call_1" not in text and "[AVAILABLE_TOOLS]" in text


def test_mistral_template_keeps_our_own_ids():
    ours = mistral_call_id()
    assert is_mistral_id(ours) and mistral_id_for(ours) == ours
    messages = [HISTORY[0],
                ChatMessage(role="assistant", content=None, tool_calls=[
                    {"id": ours, "function": {"name": "get_time", "arguments": "{}"}}]),
                ChatMessage(role="tool", tool_call_id=ours, content="14:05")]
    text = render(MISTRAL, plan_tools([WEATHER], None, None, MISTRAL), messages)
    assert f'"id": "{ours}"' in text and f'"call_id": "{ours}"' in text
