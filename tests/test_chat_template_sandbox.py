"""Chat-template sandbox (tokenmill.chat_template), issue 23: a template from the model files
that reaches for Python internals or files, or loops / grows without end, stops with a
ChatTemplateError saying why; real HF templates render exactly as plain Jinja renders them."""
import json
import threading
from datetime import datetime

import pytest
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tests.entrypoints.openai.test_tool_choice import CHATML, MISTRAL, QWEN
from tokenmill.chat_template import ChatTemplateError, ChatTemplateRenderer, TemplateLimits

# Structural re-creations of real templates' features (not verbatim copies): Llama 3.1 (tools as
# indented JSON, date, system message pulled out), Gemma (alternation check, role renaming,
# content parts), Qwen3 (reverse scan with a namespace, <think> splitting), a macro template.
LLAMA31 = """{{- bos_token }}
{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is defined and tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is defined and tools is not none %}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
{%- endif %}
{{- system_message }}{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'tool' or 'tool_calls' in message and message.tool_calls) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif message.tool_calls %}
        {%- if not message.tool_calls|length == 1 %}{{- raise_exception("one call at a time") }}{%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "' + tool_call.name + '", "parameters": ' }}
        {{- tool_call.arguments | tojson }}{{- "}<|eot_id|>" }}
    {%- else %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping %}{{- message.content | tojson }}{%- else %}{{- message.content }}{%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""

GEMMA = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}{%- set first_user_prefix = "" -%}{%- set loop_messages = messages -%}{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}{{ message['content'] | trim }}
    {%- else -%}{%- for item in message['content'] -%}
        {%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}
    {%- endfor -%}{%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"""

QWEN3 = """{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "assistant" %}
        {%- set content = message.content %}{%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning_content %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""

MACROS = """{%- macro render(m, sep) -%}[{{ m.role | upper }}]{{ sep }}{{ m.content }}{%- endmacro -%}
{%- set sep = joiner(" | ") -%}
{%- for m in messages -%}{{ sep() }}{{ render(m, ': ') }}{%- endfor -%}
{%- set footer %}{{ messages | length }} turns{% endset %} ({{ footer }}, {{ '%s/%d' | format('n', 2) }}, {{ '{}-{}'.format('a', 1) }}, {{ messages | map(attribute='role') | join(',') }})"""

CHAT = [{"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hi <b>there</b> & 'you'"},
        {"role": "assistant", "content": "<think>\nthinking\n</think>\n\nHello! 🎉"},
        {"role": "user", "content": "日本語 \x00\x1b[31m\r\n\u2028 \ufeff?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOL_CHAT = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": "call12345", "type": "function",
                  "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "content": "22 C", "tool_call_id": "call12345"},
             {"role": "user", "content": "Thanks"}]


def _plain_jinja(source: str, variables: dict) -> str:
    """The environment the sandbox replaced, without budgets: the reference output."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda v, ensure_ascii=False, indent=None, separators=None, \
        sort_keys=False: json.dumps(v, ensure_ascii=ensure_ascii, indent=indent,
                                    separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise TemplateError(message)
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source).render(**variables)


def _vars(messages, **extra) -> dict:
    return dict(messages=messages, add_generation_prompt=True, bos_token="<s>",
                eos_token="</s>", **extra)


@pytest.mark.parametrize("source,variables", [
    (CHATML, _vars(CHAT)), (QWEN, _vars(TOOL_CHAT, tools=TOOLS)), (MISTRAL, _vars(TOOL_CHAT)),
    (LLAMA31, _vars(CHAT)), (LLAMA31, _vars(TOOL_CHAT[:1], tools=TOOLS)),
    (GEMMA, _vars(CHAT[:2] + [CHAT[2], {"role": "user", "content": [
        {"type": "text", "text": " parts "}, {"type": "image"}]}])),
    (QWEN3, _vars(CHAT, enable_thinking=False)), (MACROS, _vars(CHAT)),
], ids=["chatml", "qwen-tools", "mistral-tools", "llama31", "llama31-tools", "gemma", "qwen3",
        "macros"])
def test_real_templates_render_like_plain_jinja(source, variables):
    want = _plain_jinja(source, variables)
    assert ChatTemplateRenderer().render(source, variables) == want
    assert len(want) > 40


def test_template_errors_of_real_templates_stay_clear():
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ChatTemplateRenderer().render(GEMMA, _vars(CHAT[1:2] * 2))


def test_generation_tag_renders_its_body():
    source = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
              "A: {{ m.content }}{% endgeneration %}{% else %}U: {{ m.content }}{% endif %}"
              "{{ '\\n' }}{% endfor %}")
    assert ChatTemplateRenderer().render(source, _vars(CHAT[1:3])) == (
        "U: Hi <b>there</b> & 'you'\nA: <think>\nthinking\n</think>\n\nHello! 🎉\n")


def test_megabyte_message_renders_whole():
    content = "word " * 200_000 + "🎉"   # 1 MB of text in one message
    out = ChatTemplateRenderer().render(CHATML, _vars([{"role": "user", "content": content}]))
    assert content in out and len(out) < len(content) + 200


@pytest.mark.parametrize("source,attribute", [
    ("{{ ''.__class__.__mro__ }}", "__class__"),
    ("{{ cycler.__init__.__globals__ }}", "__init__"),
    ("{{ joiner.__init__.__globals__['os'] }}", "__init__"),
    ("{{ self._TemplateReference__context }}", "_TemplateReference__context"),
    ("{{ namespace.__init__.__globals__ }}", "__init__"),
    ("{% set ns = namespace() %}{{ ns.__class__ }}", "__class__"),
    ("{{ raise_exception.__globals__ }}", "__globals__"),
    ("{{ strftime_now.__globals__['datetime'] }}", "__globals__"),
    ("{{ range.__globals__ }}", "__globals__"),
    ("{{ dict.mro() }}", "mro"),
    ("{{ messages.__class__.__subclasses__() }}", "__class__"),
    ("{{ ().__class__.__base__.__subclasses__() }}", "__class__"),
    ("{{ messages[0]|attr('__class__') }}", "__class__"),
    ("{{ messages[0]['__class__'] }}", "__class__"),
    ("{{ '{0.__class__}'.format(1) }}", "__class__"),                 # format-string fields
    ("{{ '{x.__class__.__mro__}'.format_map({'x': 1}) }}", "__class__"),
    ("{{ ('{0.__class__}'|attr('format'))(1) }}", "__class__"),
    ("{{ '%s' % ''.__class__ }}", "__class__"),
    ("{% if ''.__class__ %}yes{% endif %}", "__class__"),          # not just when printed
    ("{{ messages.append(1) }}", "append"),                       # immutable
    ("{{ messages[0].update({'role': 'system'}) }}", "update"),
])
def test_python_internals_are_refused(source, attribute):
    with pytest.raises(ChatTemplateError, match=f"tried to access attribute '{attribute}' of a "
                                                f"'[A-Za-z]+' object, which the sandbox forbids"):
        ChatTemplateRenderer().render(source, _vars(CHAT))


@pytest.mark.parametrize("name", ["lipsum", "config", "request", "cycler.__init__.__globals__.os"])
def test_no_globals_beyond_the_hf_ones(name):
    source = f"{{{{ {name}.__globals__ }}}}" if "." not in name else f"{{{{ {name}.system('x') }}}}"
    with pytest.raises(ChatTemplateError):
        ChatTemplateRenderer().render(source, _vars(CHAT))


@pytest.mark.parametrize("source,name", [
    ("{% include '/etc/passwd' %}", "/etc/passwd"), ("{% import 'x.j2' as x %}", "x.j2"),
    ("{% from '../secrets.j2' import key %}", "../secrets.j2"),
    ("{% extends 'base.j2' %}", "base.j2"),
    ("{% include ['a.j2', 'b.j2'] %}", "['a.j2', 'b.j2']"),
])
def test_templates_cannot_read_files(source, name):
    with pytest.raises(ChatTemplateError, match="cannot include, import or extend other files") as e:
        ChatTemplateRenderer().render(source, _vars(CHAT))
    assert repr(name) in str(e.value)


# Limits small enough that each case stops in milliseconds; the defaults stop the same shapes.
SMALL = TemplateLimits(max_seconds=5, max_output_chars=100_000, max_loop_iterations=10_000,
                       max_total_chars=1_000_000)
STRING = r"tried to build a string of \d+ characters; the limit is 100000"
ITEMS = r"tried to build \d+ items; the limit is 10000"
NUMBER = "computed a number of more than 65536 bits"
LOOPS = "ran more than 10000 loop iterations"
NS = "{% set ns = namespace(s='ab', l=['x']) %}"


@pytest.mark.parametrize("source,message", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", LOOPS),
    ("{% for c in 'x' * 99999 %}{% endfor %}", LOOPS),
    ("{% for i in range(10) recursive %}{{ loop(range(10)) }}{% endfor %}", "recursed too deeply"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed too deeply"),
    ("{{ range(10**12) | length }}", "Range too big"),
    ("{{ 'x' * 10**9 }}", STRING), ("{{ 10**9 * 'x' }}", STRING), ("{{ [1] * 10**8 }}", ITEMS),
    ("{{ 10 ** (10 ** 9) }}", NUMBER), ("{{ (10 ** 4000) * (10 ** 20000) }}", NUMBER),
    ("{{ 'x' | center(10**9) }}", STRING), ("{{ 'a\nb' | indent(10**9) }}", STRING),
    ("{{ 'a b c' | wordwrap(1, wrapstring='-' * 99999) }}", STRING),
    ("{{ ['x'] | map('center', 10**9) | list }}", STRING),
    ("{% filter center(10**9) %}x{% endfilter %}", STRING),
    ("{{ '%0999999999d' % 1 }}", STRING), ("{{ '%*d' % (10**9, 1) }}", STRING),
    ("{{ '%.*f' % (10**9, 1.0) }}", STRING), ("{{ '%0999999999d' | format(1) }}", STRING),
    ("{{ ('%s' * 1000) % (('x' * 1000,) * 1000) }}", STRING),
    ("{{ ('%(a)s' * 1000) % {'a': 'x' * 1000} }}", STRING),
    ("{{ '{:>999999999}'.format(1) }}", STRING), ("{{ '{0:{1}}'.format(1, 999999999) }}", STRING),
    ("{{ ('{0}' * 1000).format('x' * 1000) }}", STRING),
    ("{{ (['x'] * 1000) | join('y' * 1000) }}", STRING),
    ("{{ ('y' * 1000).join(['x'] * 1000) }}", STRING),
    ("{{ ('x' * 1000) | replace('', 'y' * 1000) }}", STRING),
    ("{{ ('x' * 1000).replace('x', 'y' * 1000) }}", STRING),
    ("{{ ('x' * 1000).translate({120: 'y' * 1000}) }}", STRING),
    ("{{ ('\t' * 1000).expandtabs(10**6) }}", STRING), ("{{ 'x'.ljust(10**9) }}", STRING),
    ("{{ 'x'.zfill(10**9) }}", STRING), ("{{ (1).to_bytes(10**9, 'big') }}", STRING),
    ("{{ [1] | tojson(indent=10**9) }}", STRING),
    ("{{ ([1] * 1000) | tojson(separators=(',' * 1000, ':')) }}", STRING),
    ("{{ {}.fromkeys('x' * 99999) }}", ITEMS), ("{{ [1] | batch(10**8, 0) | list }}", ITEMS),
    ("{{ [1] | slice(10**8) | list }}", ITEMS), ("{{ ('x' * 99999) | list }}", ITEMS),
    # doubling: through a namespace in a loop (+, ~, a macro), and through a list
    (NS + "{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", STRING),
    (NS + "{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", STRING),
    (NS + "{% macro d(s) %}{{ s }}{{ s }}{% endmacro %}"
          "{% for i in range(64) %}{% set ns.s = d(ns.s) %}{% endfor %}", STRING),
    (NS + "{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}{% endfor %}", ITEMS),
    # output and buffers that grow without end
    ("{% for i in range(10**5) %}{{ 'x' * 100 }}{% endfor %}", "output exceeded 100000 characters"),
    ("{% set b %}{% for i in range(10**5) %}{{ 'x' * 100 }}{% endfor %}{% endset %}", STRING),
    ("{% macro m() %}{% for i in range(10**5) %}{{ 'x' * 100 }}{% endfor %}{% endmacro %}{{ m() }}",
     STRING),
    # many strings kept alive at once
    ("{% set ns = namespace(l=[]) %}{% set big = 'x' * 99999 %}{% for i in range(1000) %}"
     "{% set ns.l = ns.l + [big ~ i] %}{% endfor %}", "built more than 1000000 characters in all"),
])
def test_budgets_stop_runaway_templates(source, message):
    with pytest.raises(ChatTemplateError, match=message):
        ChatTemplateRenderer(SMALL).render(source, _vars(CHAT))


@pytest.mark.parametrize("source,message", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "ran more than 1000000 loop iterations"),
    ("{{ 'x' * 10**9 }}", "a string of 1000000000 characters; the limit is 16777216"),
    ("{{ [1] * 10**8 }}", "100000000 items; the limit is 1000000"),
    ("{{ 'x' | center(10**9) }}", "a string of 1000000000 characters"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{{ 'x' * 1000 }}{% endfor %}"
     "{% endfor %}", "output exceeded 16777216 characters"),
])
def test_default_limits_stop_the_classic_bombs(source, message):
    with pytest.raises(ChatTemplateError, match=message):
        ChatTemplateRenderer().render(source, _vars(CHAT))


def test_time_budget():
    limits = TemplateLimits(max_seconds=0.2, max_loop_iterations=10**12)
    source = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="ran past its time budget of 0.2 s"):
        ChatTemplateRenderer(limits).render(source, {})


def test_budgets_are_per_render_and_per_thread():
    renderer = ChatTemplateRenderer(TemplateLimits(max_seconds=0.5, max_loop_iterations=10**12))
    hostile = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    want = _plain_jinja(CHATML, _vars(CHAT))
    outputs, errors = [], []

    def attack():
        try:
            renderer.render(hostile, {})
        except ChatTemplateError as e:
            errors.append(str(e))

    thread = threading.Thread(target=attack)
    thread.start()
    while thread.is_alive():   # the same renderer keeps serving good renders meanwhile
        outputs.append(renderer.render(CHATML, _vars(CHAT)))
    thread.join()
    assert errors and "time budget" in errors[0]
    assert outputs and all(out == want for out in outputs)
    assert renderer.render(CHATML, _vars(CHAT)) == want   # a failure leaves nothing behind


@pytest.mark.parametrize("kwargs", [dict(max_seconds=0), dict(max_seconds=float("nan")),
                                    dict(max_output_chars=0), dict(max_loop_iterations=-1),
                                    dict(max_total_chars=0)])
def test_limits_are_validated(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        TemplateLimits(**kwargs)
