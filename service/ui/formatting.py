"""How numbers read on a page: the Jinja filters of the web pages.

Bytes and kept checkpoints are spelled as the CLI spells them (``remat.client.cli_common``), so a figure on a
page and in a terminal look alike; a missing figure is an en dash, never an empty cell or ``None``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from remat.client.cli_common import format_bytes, format_kept
from remat.client.plan import Plan

__all__ = ["FILTERS", "MISSING"]

MISSING = "–"


def size(n: int | None) -> str:
    return MISSING if n is None else format_bytes(n)


def percent(value: float | None, signed: bool = False) -> str:
    """``0.452`` → ``45.2%`` (``+45.2%`` when ``signed``)."""
    if value is None:
        return MISSING
    if abs(value) < 0.0005:  # what rounds to 0.0% is 0.0%, never "-0.0%"
        value = 0.0
    return f"{value:+.1%}" if signed else f"{value:.1%}"


def ms(value: float | None) -> str:
    if value is None:
        return MISSING
    return f"{value:.1f} ms" if value < 100 else f"{value:.0f} ms"


def when(value: datetime | None) -> str:
    """A stored time in UTC to the minute: what a table needs to tell runs apart (headers say UTC)."""
    return MISSING if value is None else value.strftime("%Y-%m-%d %H:%M")


def iso(value: datetime | None) -> str:
    return "" if value is None else value.isoformat()


def short_hash(value: str, length: int = 10) -> str:
    return value if len(value) <= length else value[:length]


def shape(values: Sequence[int] | None) -> str:
    return MISSING if values is None else "[" + ", ".join(str(v) for v in values) + "]"


def kept(plan: Plan) -> str:
    return format_kept(plan)


def yes_no(value: bool | None) -> str:
    return MISSING if value is None else ("yes" if value else "no")


FILTERS = {"size": size, "percent": percent, "ms": ms, "when": when, "iso": iso, "short_hash": short_hash,
           "shape": shape, "kept": kept, "yes_no": yes_no}
