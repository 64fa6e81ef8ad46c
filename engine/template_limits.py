"""Time and size limits for rendering a chat template that came in a downloaded file.

jinja2's sandbox stops a template from reaching Python internals, but not from running forever
(`{% for i in range(10**5) %}{% for j in range(10**5) %}` is ten billion steps) or building a
400 MB string (`'x' * 400000000`). Both would hang the reply, and in the app a hung worker keeps
the process from quitting. Three limits close that:

- Arithmetic that would make a string, list or number too large is refused before it runs
  (`LimitedSandbox.call_binop`), and so are filter calls with absurd sizes (`center(10**9)`).
- Output is produced chunk by chunk (`Template.generate`) and refused once it passes
  `MAX_OUTPUT_CHARS`.
- A watchdog timer raises `TemplateLimitError` inside the rendering thread when `TIME_LIMIT_S`
  passes (`PyThreadState_SetAsyncExc`: template code is pure Python bytecode, so it stops at the
  next instruction, even in a loop that writes nothing).

The caller treats a limit like any other template failure: fall back to the known format and
warn the user.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterable
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

TIME_LIMIT_S = 1.0
"""A real template renders in milliseconds; this is for templates that never finish."""
MAX_OUTPUT_CHARS = 1 << 23
"""8 Mi characters: several times the longest context of any model we run."""
MAX_VALUE_SIZE = 1 << 23
"""The largest string, list or integer (in digits) arithmetic in a template may create."""
MAX_ARGUMENT = 1 << 20
"""The largest whole number a filter may be given (a width, a count)."""


class TemplateLimitError(BaseException):
    """A template ran past a limit. A BaseException so that no `except Exception` on the way
    (ours or jinja2's) can swallow the watchdog's interruption."""


def _size(value: Any) -> int:
    if isinstance(value, str | bytes | list | tuple):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return max(1, value.bit_length() * 3 // 10)  # decimal digits, roughly
    return 1


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with arithmetic that cannot allocate without bound."""

    intercepted_binops = frozenset({"*", "**", "+", "//", "%"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if _result_size(operator, left, right) > MAX_VALUE_SIZE:
            raise TemplateLimitError("a value in the template grew too large")
        return super().call_binop(context, operator, left, right)


def _result_size(operator: str, left: Any, right: Any) -> int:
    """An upper bound on the size of `left <operator> right`, computed without computing it."""
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, str | list | tuple) and isinstance(times, int):
                return len(seq) * max(times, 0)
        return _size(left) + _size(right)
    if operator == "**" and isinstance(left, int | float) and isinstance(right, int | float):
        return MAX_VALUE_SIZE + 1 if abs(right) > 4096 else _size(left) * max(int(abs(right)), 1)
    if operator == "+":
        return _size(left) + _size(right)
    return _size(left)


def guard_filters(env: jinja2.Environment) -> None:
    """Refuse filter calls whose whole-number arguments are absurd (widths, counts)."""

    def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            for arg in (*args, *kwargs.values()):
                if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > MAX_ARGUMENT:
                    raise TemplateLimitError(f"a filter was given {arg}")
            return fn(*args, **kwargs)

        for attr in ("jinja_pass_arg",):  # keep jinja2's pass_context/pass_environment marks
            if hasattr(fn, attr):
                setattr(call, attr, getattr(fn, attr))
        return call

    env.filters = {name: guarded(fn) for name, fn in env.filters.items()}


def _raise_in(thread_id: int) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(TemplateLimitError)
    )


def _settle() -> None:
    """A few bytecodes where an interruption raised just as the render ended lands."""
    for _ in range(3):
        pass


def render_limited(
    template: jinja2.Template,
    context: dict[str, Any],
    *,
    time_limit_s: float | None = None,
    max_chars: int | None = None,
) -> str:
    """`template.render(**context)` within the limits; TemplateLimitError past any of them."""
    limit_s = TIME_LIMIT_S if time_limit_s is None else time_limit_s
    limit_chars = MAX_OUTPUT_CHARS if max_chars is None else max_chars
    lock = threading.Lock()
    state = {"rendering": True}
    target = threading.get_ident()

    def expire() -> None:
        with lock:
            if state["rendering"]:
                _raise_in(target)

    timer = threading.Timer(limit_s, expire)
    timer.daemon = True
    parts: list[str] = []
    try:
        timer.start()
        try:
            total = 0
            chunks: Iterable[str] = template.generate(**context)
            for chunk in chunks:
                total += len(chunk)
                if total > limit_chars:
                    raise TemplateLimitError(f"the output passed {limit_chars} characters")
                parts.append(chunk)
        finally:
            with lock:
                state["rendering"] = False
            timer.cancel()
        _settle()
    except TemplateLimitError as exc:
        if str(exc):
            raise
        raise TemplateLimitError(f"rendering took longer than {limit_s:g} s") from None
    return "".join(parts)
