"""One reading of JSON for everything remat accepts from outside: request bodies, trace files and uploads,
the service's answers, ``--model-kwargs``.

Python's ``json.loads`` accepts more than JSON and more than remat can keep:

- ``NaN``, ``Infinity`` and ``-Infinity`` (not JSON at all), and ``1e400`` (parsed as ``inf``): stored, they
  make every later ``json.dumps(..., allow_nan=False)`` of the row fail, so one write turns every read of a
  key into a 500 (issue 31), and PostgreSQL's ``jsonb`` refuses them with an unmapped ``DataError``;
- integers of any length: past 4,300 digits ``int()`` raises ``ValueError``, and past 64 bits neither a
  ``BIGINT`` column nor a JavaScript reader holds them;
- nesting as deep as the C stack allows: a 1,000-deep array raises ``RecursionError`` here, and a 900-deep one
  that parses is stored, then breaks whatever walks it recursively later (a worker, a validator);
- lone surrogates (``"\\ud800"``): a ``str`` that UTF-8 cannot encode, so the database write fails.

:func:`loads` refuses all of these with :class:`WireJSONError`, whose message names where the value is
(``extra.x: ...``), and :func:`check` applies the same rules to a value already in memory (one a
validator received, or one about to be written). Everything else is ``json.loads``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

MAX_DEPTH = 32
"""Containers inside containers: a trace is 5 deep (trace -> graph -> vertices -> vertex -> list), a measured
timeline 4; 32 leaves room for any honest payload and none for a stack-breaking one."""
MAX_INT = 2**63 - 1
"""The largest magnitude of an integer: a PostgreSQL ``BIGINT``; bytes and counts are far below it."""
_MAX_INT_DIGITS = len(str(MAX_INT)) + 1  # a sign, then at most 19 digits

__all__ = ["MAX_DEPTH", "MAX_INT", "WireJSONError", "check", "loads", "place"]


def place(parts: Sequence[str | int]) -> str:
    """Where a value is, on one line: ``extra.x``, ``stages[0].name``, ``extra["a b\\n"]``. Keys that are not
    identifiers are quoted as JSON strings (ASCII, escaped, at most 40 characters), so that no name a client
    sends can break a one-line error message."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part.isascii():
            out += f".{part}" if out else part
        else:
            quoted = json.dumps(part)
            out += f"[{quoted if len(quoted) <= 40 else quoted[:36] + '...' + quoted[-1]}]"
    return out


class WireJSONError(ValueError):
    """JSON that remat does not accept; the message starts with where the offending value is."""


class _Refused:
    """A number the parser met but must not produce; :func:`check` reports it with its place."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _refuse_constant(text: str) -> _Refused:
    return _Refused(text)


def _parse_float(text: str) -> float | _Refused:
    value = float(text)
    return value if math.isfinite(value) else _Refused(text)


def _parse_int(text: str) -> int | _Refused:
    if len(text) > _MAX_INT_DIGITS:  # before int(): a 4,301-digit literal raises, a 4,000-digit one is slow
        return _Refused(text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)")
    value = int(text)
    return value if -MAX_INT <= value <= MAX_INT else _Refused(text)


def loads(data: str | bytes | bytearray, *, where: str = "body", max_depth: int = MAX_DEPTH) -> Any:
    """Parse JSON text, refusing what remat cannot keep (module docstring).

    Raises:
        WireJSONError: naming the offending value's path (``extra.x``, ``stages[0].name``, the way request
            validation names fields), or ``where`` when the whole text is at fault.
    """
    try:
        value = json.loads(data, parse_constant=_refuse_constant, parse_float=_parse_float, parse_int=_parse_int)
    except json.JSONDecodeError as exc:
        raise WireJSONError(f"{where}: not valid JSON ({exc.msg}: line {exc.lineno} column {exc.colno})") from None
    except UnicodeDecodeError:
        raise WireJSONError(f"{where}: not valid JSON (not UTF-8 text)") from None
    except RecursionError:
        raise WireJSONError(f"{where}: nested more than {max_depth} levels deep") from None
    check(value, where=where, max_depth=max_depth)
    return value


def check(value: Any, *, where: str = "body", max_depth: int = MAX_DEPTH) -> None:
    """Refuse a value that holds what :func:`loads` refuses: non-finite floats, integers past 64 bits, lone
    surrogates, nesting past ``max_depth`` (a container at the top is depth 1).

    One pass without paths (the common case: nothing is wrong); a second pass names the place.
    """
    if _first_problem(value, max_depth, with_path=False) is not None:
        problem = _first_problem(value, max_depth, with_path=True)
        assert problem is not None
        path, what = problem
        raise WireJSONError(f"{path or where}: {what}")


def _describe(value: Any) -> str | None:
    """Why a scalar cannot be kept, or None."""
    if isinstance(value, _Refused):
        return f"{value.text} is not a number remat accepts (finite numbers, integers within 64 bits)"
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value} is not a finite number"
    if isinstance(value, int) and not isinstance(value, bool):
        return None if -MAX_INT <= value <= MAX_INT else "an integer beyond 64 bits"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "not valid Unicode (a lone surrogate)"
    return None


def _first_problem(value: Any, max_depth: int, *, with_path: bool) -> tuple[str, str] | None:
    """Iterative (a recursive walk is what deep input breaks): ``(path, why)`` of the first bad value."""
    stack: list[tuple[Any, int, tuple[str | int, ...]]] = [(value, 0, ())]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, dict):
            if depth + 1 > max_depth:
                return place(path), f"nested more than {max_depth} levels deep"
            for key, child in item.items():
                why = _describe(key)
                if why is not None:
                    return place(path), f"a key is {why}"
                stack.append((child, depth + 1, (*path, key) if with_path else ()))
        elif isinstance(item, list | tuple):
            if depth + 1 > max_depth:
                return place(path), f"nested more than {max_depth} levels deep"
            stack.extend((child, depth + 1, (*path, i) if with_path else ()) for i, child in enumerate(item))
        else:
            why = _describe(item)
            if why is not None:
                return place(path), why
    return None
