"""The budgets of a chat template's render (tokenmill.chat_template): the limits, the
per-render counters, and the size checks made *before* an operation whose small inputs can
ask for a huge result (``*``, ``**``, ``%``, format widths, ``center``, ``replace`` ...)."""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from jinja2.sandbox import SecurityError

# Integers this big only come from a template computing something absurd, and big-int
# multiplication and powers slow down with size (`10 ** (10 ** 9)` would never finish).
_MAX_INT_BITS = 1 << 16
_BIG_NUMBER = f"the chat template computed a number of more than {_MAX_INT_BITS} bits"
# Strings and lists shorter than this skip the checks after a call, filter or sum (hooks that
# run several times per turn): they are far from every limit, and only a loop could pile them
# up, which the loop and time budgets bound.
SMALL = 256
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?")  # width.precision
DIGITS = re.compile(r"\d+")
SIZED = (str, bytes, list, tuple)
AMPLIFIERS = (str, bytes, int, dict, type)   # owners of the methods check_call knows


class ChatTemplateError(ValueError):
    """The chat template failed or was stopped; the message says why."""


@dataclass(frozen=True)
class TemplateLimits:
    """Budgets for one render. The defaults are far above what real chat templates need
    (microseconds to milliseconds, a loop or two over the messages, the messages copied a few
    times) for any request the server's body limit (8 MiB by default) lets in."""

    max_seconds: float = 2.0
    max_output_chars: int = 16 * 2**20    # the output, and each string the template builds
    max_loop_iterations: int = 1_000_000  # all loops together, and each list's length
    max_total_chars: int = 128 * 2**20    # all strings built and written together

    def __post_init__(self) -> None:
        if not self.max_seconds > 0:
            raise ValueError(f"max_seconds must be > 0, got {self.max_seconds}")
        for name in ("max_output_chars", "max_loop_iterations", "max_total_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class Budget:
    """What one render may still spend. Its errors are SecurityErrors, which nothing inside
    Jinja catches or confuses with the template's own errors; the renderer converts them."""

    __slots__ = ("limits", "deadline", "loops_left", "chars_left")

    def __init__(self, limits: TemplateLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.max_seconds
        self.loops_left = limits.max_loop_iterations
        self.chars_left = limits.max_total_chars

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise SecurityError(f"the chat template ran past its time budget of "
                                f"{self.limits.max_seconds:g} s")

    def iterate(self) -> None:
        if self.loops_left < 0:
            raise SecurityError(f"the chat template ran more than "
                                f"{self.limits.max_loop_iterations} loop iterations")
        self.tick()

    def check_size(self, size: Any) -> None:
        """Characters of one string about to be built (or just built)."""
        if isinstance(size, int) and size > self.limits.max_output_chars:
            raise SecurityError(f"the chat template tried to build a string of {size} "
                                f"characters; the limit is {self.limits.max_output_chars}")

    def check_count(self, count: Any) -> None:
        """Items of a list about to be built. Lists share the loop budget: whatever is done
        to a list (sort, map, select) is a loop over it that no hook interrupts."""
        if isinstance(count, int) and count > self.limits.max_loop_iterations:
            raise SecurityError(f"the chat template tried to build {count} items; the limit "
                                f"is {self.limits.max_loop_iterations}")

    def spend(self, chars: int) -> None:
        self.chars_left -= chars
        if self.chars_left < 0:
            raise SecurityError(f"the chat template built more than "
                                f"{self.limits.max_total_chars} characters in all")
        self.tick()

    def check_value(self, value: Any) -> Any:
        if isinstance(value, (str, bytes)):
            self.check_size(len(value))
            self.spend(len(value))
        elif isinstance(value, (list, tuple, dict)):
            self.check_count(len(value))
        elif isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
            raise SecurityError(_BIG_NUMBER)
        return value


def checked(budget: Budget, value: Any) -> Any:
    """check_value, with the common small results (short strings, booleans) let through."""
    if isinstance(value, SIZED):
        return value if len(value) < SMALL else budget.check_value(value)
    return budget.check_value(value) if isinstance(value, (int, dict)) else value


# -- sizes known before an operation runs -------------------------------------------------------
def check_binop(budget: Budget, op: str, left: Any, right: Any) -> None:
    ints = isinstance(left, int) and isinstance(right, int)
    if op == "*" and ints and left.bit_length() + right.bit_length() > _MAX_INT_BITS:
        raise SecurityError(_BIG_NUMBER)
    if op == "**" and ints and right > 0 and max(left.bit_length(), 1) * right > _MAX_INT_BITS:
        raise SecurityError(_BIG_NUMBER)
    if op == "*" and not ints:
        seq, times = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(seq, SIZED) and isinstance(times, int):
            check = budget.check_size if isinstance(seq, (str, bytes)) else budget.check_count
            check(len(seq) * times)
    if op == "%" and isinstance(left, str):
        budget.check_size(_percent_bound(left, right))


def _percent_bound(fmt: str, args: Any) -> int:
    """At most how long ``fmt % args`` is: the format, the arguments' text (a mapping's
    values may each be used by every conversion) and the widest width or precision."""
    specs = _PERCENT_SPEC.findall(fmt)
    if not specs:
        return len(fmt)
    values = args if isinstance(args, tuple) else (
        tuple(args.values()) if isinstance(args, dict) else (args,))
    widths = [int(n) for spec in specs for n in spec if n.isdigit()]
    if any("*" in spec for spec in specs):
        widths += [v for v in values if isinstance(v, int)]
    lengths = [len(v) if isinstance(v, str) else len(str(v)) for v in values]
    text = sum(lengths) if isinstance(args, tuple) else len(specs) * max(lengths, default=0)
    return len(fmt) + text + len(specs) * max(widths, default=0)


def _replace_bound(text: Any, old: Any, new: Any, count: Any = -1) -> int:
    try:
        n = text.count(old) if len(old) else len(text) + 1
        n = min(n, count) if isinstance(count, int) and count >= 0 else n
        return len(text) + n * max(len(new) - len(old), 0)
    except TypeError:   # wrong argument types: the call itself raises the clear error
        return 0


def check_call(budget: Budget, func: Any, owner: Any, args: tuple, kwargs: dict) -> tuple:
    """Sizes before the built-in methods that can amplify (width, tab size, replacement,
    separator, translation table, byte count, key count). Returns the arguments to call with:
    an iterable to join is read once, here."""
    name, first = getattr(func, "__name__", ""), args[0] if args else None
    if isinstance(owner, (str, bytes)):
        if name in ("center", "ljust", "rjust", "zfill"):
            budget.check_size(first)
        elif name == "expandtabs":
            size = first if args else kwargs.get("tabsize", 8)
            tab = "\t" if isinstance(owner, str) else b"\t"
            budget.check_size(len(owner) + owner.count(tab) * size if isinstance(size, int) else 0)
        elif name == "replace" and len(args) >= 2:
            budget.check_size(_replace_bound(owner, *args[:3]))
        elif name == "join" and args:
            items = list(first)
            lengths = [len(i) for i in items if isinstance(i, (str, bytes))]
            budget.check_size(len(owner) * max(len(items) - 1, 0) + sum(lengths))
            return (items, *args[1:])
        elif name == "translate" and isinstance(first, (dict, list, tuple)):
            table = first.values() if isinstance(first, dict) else first
            longest = max((len(v) for v in table if isinstance(v, (str, bytes))), default=1)
            budget.check_size(len(owner) * longest)
    elif name == "to_bytes" and isinstance(owner, int):
        budget.check_size(first if args else kwargs.get("length", 1))
    elif name == "fromkeys" and hasattr(first, "__len__"):
        budget.check_count(len(first))
    return args


# -- filters ----------------------------------------------------------------------------------
def _pre_center(budget: Budget, value: Any, width: Any = 80) -> None:
    budget.check_size(width)


def _pre_indent(budget: Budget, s: Any, width: Any = 4, *args: Any, **kwargs: Any) -> None:
    text, indent = str(s), width if isinstance(width, int) else len(str(width))
    budget.check_size(len(text) + (text.count("\n") + 1) * indent)


def _pre_wordwrap(budget: Budget, s: Any, width: Any = 79, break_long_words: Any = True,
                  wrapstring: Any = None, **kwargs: Any) -> None:
    # each line holds at least one character of the text and ends in the wrap string
    text, wrap = str(s), 1 if wrapstring is None else len(str(wrapstring))
    budget.check_size(len(text) + (len(text) + 1) * wrap)


def _pre_format(budget: Budget, value: Any, *args: Any, **kwargs: Any) -> None:
    budget.check_size(_percent_bound(str(value), kwargs or args))


def _pre_replace(budget: Budget, s: Any, old: Any, new: Any, count: Any = None) -> None:
    budget.check_size(_replace_bound(str(s), str(old), str(new), -1 if count is None else count))


def _pre_count(budget: Budget, value: Any, count: Any, *args: Any, **kwargs: Any) -> None:
    budget.check_count(count)   # batch pads its last list to `count` items; slice makes `count`


PRECHECKS = {"center": _pre_center, "indent": _pre_indent, "wordwrap": _pre_wordwrap,
              "format": _pre_format, "replace": _pre_replace, "batch": _pre_count,
              "slice": _pre_count}
