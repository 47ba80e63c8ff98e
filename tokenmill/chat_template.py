"""Chat templates: Jinja code from the model files, rendered in a sandbox with budgets.

A template comes from GGUF metadata, ``tokenizer_config.json`` or ``chat_template.jinja`` (never
from a request): code someone else wrote, run on text a client sent. Jinja's
ImmutableSandboxedEnvironment already refuses Python internals and mutation. Added here:

- an unsafe attribute is an error at once (Jinja hands back an Undefined that prints as "", so
  an escape attempt would pass unnoticed);
- no loader: ``include`` / ``import`` / ``extends`` are refused, naming the template;
- budgets per render (TemplateLimits): time, checked at every loop iteration, call, filter,
  operator and write; loop iterations; the size of each string or list the template builds,
  checked *before* it is built wherever a small input can ask for a huge result (``*``,
  ``**``, ``%``, format widths, ``center``, ``indent``, ``join``, ``replace``, ``batch`` ...)
  and right after otherwise; all characters built and written together (memory); the output.

Every failure is one ChatTemplateError (a ValueError: the server answers 400). One built-in
operation on values within the limits is never interrupted, so the time budget can be overrun
by one such operation (``|sort`` of a list at the size limit: well under a second).
"""
from __future__ import annotations

import functools
import json
import threading
import time
from datetime import datetime
from typing import Any, Iterable

from jinja2 import (TemplateError, TemplateSyntaxError, nodes, pass_context, pass_environment,
                    pass_eval_context)
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension
from jinja2.filters import make_attrgetter, sync_do_join
from jinja2.sandbox import (ImmutableSandboxedEnvironment, SandboxedEscapeFormatter,
                            SandboxedFormatter, SecurityError)
from jinja2.visitor import NodeTransformer
from markupsafe import Markup

from tokenmill.template_budget import (AMPLIFIERS, DIGITS, PRECHECKS, SIZED, SMALL, Budget,
                                       ChatTemplateError, TemplateLimits, check_binop,
                                       check_call, checked)

_LOOP_FILTER, _SIZE_FILTER = "tokenmill_loop_budget", "tokenmill_size_budget"
def _budgeted(env: "_SandboxEnvironment", func, precheck=None):
    """``func`` spending the render's budget: a tick, the precheck, a size check after."""
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0   # context / env

    @functools.wraps(func)   # keeps jinja_pass_arg, so Jinja passes the same first argument
    def budgeted(*args: Any, **kwargs: Any) -> Any:
        budget = env.local.budget   # (hot path: no budget() call)
        if time.monotonic() > budget.deadline:
            budget.tick()
        if precheck is not None:
            precheck(budget, *args[skip:], **kwargs)
        return checked(budget, func(*args, **kwargs))
    return budgeted


@pass_context   # never folded at compile time
def _loop_budget(context, iterable: Any):
    return _counted(context.environment.budget(), iterable)


def _counted(budget: Budget, iterable: Any):
    monotonic = time.monotonic
    for item in iterable:
        budget.loops_left -= 1
        if budget.loops_left < 0 or monotonic() > budget.deadline:
            budget.iterate()   # raises the error that applies
        yield item


@pass_context
def _size_budget(context, value: Any) -> Any:
    if isinstance(value, SIZED) and len(value) < SMALL:
        return value
    return context.environment.budget().check_value(value)


@pass_eval_context
def _join(eval_ctx, value: Any, d: Any = "", attribute: Any = None) -> str:
    """Jinja's join, the result's size counted while the items turn into text."""
    if attribute is not None:
        value = map(make_attrgetter(eval_ctx.environment, attribute), value)
    budget, sep, parts, size = eval_ctx.environment.budget(), len(str(d)), [], 0
    for item in value:
        parts.append(item if isinstance(item, str) else str(item))
        size += len(parts[-1]) + sep
        budget.check_size(size)
    return sync_do_join(eval_ctx, parts, d)


@pass_environment
def _tojson(env, value: Any, ensure_ascii: bool = False, indent: Any = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    """json.dumps, as HF templates expect (Jinja's tojson HTML-escapes <, >, &, ' and would
    corrupt prompts). An indent or separators repeat per element and nesting level, so then
    the text is counted as it is produced."""
    if indent is None and separators is None:
        return json.dumps(value, ensure_ascii=ensure_ascii, sort_keys=sort_keys)
    budget, parts, size = env.budget(), [], 0
    budget.check_size(indent)
    for chunk in json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent,
                                  separators=separators, sort_keys=sort_keys).iterencode(value):
        parts.append(chunk)
        size += len(chunk)
        budget.check_size(size)
    return "".join(parts)


def _raise_exception(message: str):
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# -- the environment --------------------------------------------------------------------------
class _Local(threading.local):
    budget: "Budget | None" = None   # of the render running in this thread


class _Buffer(list):
    """The output of a macro, call block or ``{% set %}`` block, counted as it is written
    (Jinja joins it only at the end, and a loop can write without end before that)."""

    __slots__ = ("_budget", "_size")

    def __init__(self, budget: Budget) -> None:
        super().__init__()
        self._budget, self._size = budget, 0

    def append(self, text: str) -> None:
        self._write(len(text))
        list.append(self, text)

    def extend(self, texts: Iterable[str]) -> None:
        texts = tuple(texts)
        self._write(sum(map(len, texts)))
        list.extend(self, texts)

    def _write(self, chars: int) -> None:
        self._size += chars
        self._budget.check_size(self._size)
        self._budget.spend(chars)


class _CodeGenerator(CodeGenerator):
    def buffer(self, frame) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.output_buffer()")


class _Guards(NodeTransformer):
    """Rewrites a parsed template so every for-loop's iterable goes through the loop budget
    and sums (``+``, ``~``) of two or more variable parts through the size check. A sum
    with only one variable part grows it by a literal's length (Jinja's hook for ``+``
    would cost a call at every one: templates build each turn from literal + role +
    literal + content + literal); several variable parts can double a size each time."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, _LOOP_FILTER, [], [], None, None, lineno=node.lineno)
        return node

    def visit_Add(self, node: nodes.Add) -> nodes.Node:
        self.generic_visit(node)
        return self._checked(node, [node.left, node.right])

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return self._checked(node, node.nodes)

    @staticmethod
    def _checked(node: nodes.Expr, parts: list) -> nodes.Node:
        if sum(not isinstance(part, nodes.Const) for part in parts) < 2:
            return node
        return nodes.Filter(node, _SIZE_FILTER, [], [], None, None, lineno=node.lineno)


class _GenerationTag(Extension):
    """HF's ``{% generation %}...{% endgeneration %}`` marks assistant text for training
    masks; rendering a prompt only needs the body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _SizedFormat:
    """str.format with each field's width checked before it is padded, and the fields'
    total as they are produced ("{0}{0}{0}..." of a long argument)."""

    def __init__(self, env, budget: Budget, **kwargs: Any) -> None:
        super().__init__(env, **kwargs)
        self._budget, self._size = budget, 0

    def format_field(self, value: Any, format_spec: str) -> str:
        self._budget.check_size(max(map(int, DIGITS.findall(format_spec)), default=0))
        text = super().format_field(value, format_spec)
        self._size += len(text)
        self._budget.check_size(self._size)
        return text


class _SizedFormatter(_SizedFormat, SandboxedFormatter):
    pass


class _SizedEscapeFormatter(_SizedFormat, SandboxedEscapeFormatter):
    pass


class _SandboxEnvironment(ImmutableSandboxedEnvironment):
    """The environment HF chat templates are written for (trimmed blocks, loop controls,
    ``raise_exception``, ``strftime_now``, plain ``tojson``), with the budget hooks. The
    budget lives in a thread-local: one template may render in several threads at once."""

    intercepted_binops = frozenset({"*", "**", "%"})   # "+": see _Guards
    code_generator_class = _CodeGenerator

    def __init__(self, limits: TemplateLimits) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=["jinja2.ext.loopcontrols", _GenerationTag])
        self.limits, self.local = limits, _Local()
        self.concat = self._concat   # joins buffers (the generated code calls it)
        del self.globals["lipsum"]   # lipsum(n) writes n paragraphs; no chat template uses it
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        self.filters.update(tojson=_tojson, join=_join)
        for name, func in list(self.filters.items()):
            self.filters[name] = _budgeted(self, func, PRECHECKS.get(name))
        self.filters.update({_LOOP_FILTER: _loop_budget, _SIZE_FILTER: _size_budget})

    def budget(self) -> Budget:
        budget = self.local.budget
        if budget is None:
            raise RuntimeError("chat templates render only through ChatTemplateRenderer")
        return budget

    def run_budgeted(self, fn, *args: Any) -> Any:
        """``fn(budget, *args)`` under a fresh budget for this thread."""
        previous, self.local.budget = self.local.budget, Budget(self.limits)
        try:
            return fn(self.local.budget, *args)
        finally:
            self.local.budget = previous

    def compile(self, source, name=None, filename=None, raw=False, defer_init=False):
        if isinstance(source, str):
            source = self.parse(source, name, filename)
        return super().compile(_Guards().visit(source), name, filename, raw, defer_init)

    def output_buffer(self) -> _Buffer:
        return _Buffer(self.budget())

    def _concat(self, parts: Iterable[str]) -> str:
        return self.budget().check_value("".join(parts))   # _Buffer counted the parts

    # Attribute and item access (the hottest hooks) stay Jinja's own: loop iterations, calls
    # and filters check the clock, and lists are capped at the loop budget, so the accesses
    # between two checks are bounded.
    def unsafe_undefined(self, obj: Any, attribute: str):
        raise SecurityError(f"the chat template tried to access attribute {attribute!r} of a "
                            f"{type(obj).__name__!r} object, which the sandbox forbids")

    def is_safe_callable(self, obj: Any) -> bool:
        # Jinja's test, written out (it runs at every call)
        if getattr(obj, "unsafe_callable", False) or getattr(obj, "alters_data", False):
            raise SecurityError(f"the chat template tried to call "
                                f"{getattr(obj, '__name__', 'an object')!r}, which the sandbox "
                                f"forbids")
        return True

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        budget = self.budget()
        budget.tick()
        check_binop(budget, operator, left, right)
        return budget.check_value(self.binop_table[operator](left, right))

    def call(self, context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = self.local.budget   # (hot path: no budget() call)
        if time.monotonic() > budget.deadline:
            budget.tick()
        owner = getattr(obj, "__self__", None)
        if isinstance(owner, AMPLIFIERS):
            if isinstance(owner, str):
                obj = self.wrap_str_format(obj) or obj   # str.format however it was reached
            args = check_call(budget, obj, owner, args, kwargs)
        return checked(budget, super().call(context, obj, *args, **kwargs))

    def wrap_str_format(self, value: Any):
        """Jinja's sandboxed str.format, with a formatter that checks sizes. (Jinja calls
        this at every attribute access: the common case returns at the first test.)"""
        if getattr(value, "__name__", None) not in ("format", "format_map") or (
                super().wrap_str_format(value) is None):
            return None
        owner, is_map = value.__self__, value.__name__ == "format_map"
        markup = isinstance(owner, Markup)

        def sized_format(*args: Any, **kwargs: Any) -> str:
            if is_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one positional argument")
                args, kwargs = (), args[0]
            formatter = (_SizedEscapeFormatter(self, self.budget(), escape=owner.escape)
                         if markup else _SizedFormatter(self, self.budget()))
            return type(owner)(formatter.vformat(owner, args, kwargs))
        return sized_format

    def get_template(self, name, parent=None, globals=None):
        raise SecurityError(f"the chat template tried to load the template {str(name)!r}; chat "
                            f"templates cannot include, import or extend other files")

    select_template = get_or_select_template = get_template


class ChatTemplateRenderer:
    """Compiles each template source once (compiled templates serve all threads) and
    renders it under ``limits``; every failure is a ChatTemplateError."""

    def __init__(self, limits: TemplateLimits = TemplateLimits()) -> None:
        self.limits = limits
        self._env = _SandboxEnvironment(limits)
        self._cache: dict[str, Any] = {}

    def render(self, source: str, variables: dict) -> str:
        if source not in self._cache:
            # compiling folds constants, which may run filters: under a budget too
            self._cache[source] = self._guarded(lambda _, s: self._env.from_string(s), source)
        return self._guarded(self._render, self._cache[source], variables)

    def _render(self, budget: Budget, template, variables: dict) -> str:
        # Counted as it comes (Template.render joins it all at the end, after a loop that
        # writes without end; Template.generate adds a generator layer).
        limit, size, parts = self.limits.max_output_chars, 0, []
        chunks = template.root_render_func(template.new_context(variables))
        try:
            for chunk in chunks:
                size += len(chunk)
                if size > limit:
                    raise SecurityError(f"the chat template's output exceeded {limit} characters")
                parts.append(chunk)
        finally:
            chunks.close()
        budget.spend(size)
        return "".join(parts)

    def _guarded(self, fn, *args: Any) -> Any:
        try:
            return self._env.run_budgeted(fn, *args)
        except SecurityError as e:
            raise ChatTemplateError(str(e)) from None
        except TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from None
        except RecursionError:
            raise ChatTemplateError("the chat template recursed too deeply") from None
        except MemoryError:
            raise ChatTemplateError("the chat template ran out of memory") from None
        except Exception as e:  # sandboxed: any other failure is the template's or the input's
            raise ChatTemplateError(f"chat template error: {e}") from None
