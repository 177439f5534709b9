"""Where to write each point's name on a scatter picture so that no name covers another.

Both pictures of the time–memory trade (``remat-client show --plot`` with matplotlib, the web pages' SVG) name
every measured plan beside its marker. Planners often land a few pixels apart (``uniform`` and ``chen-sqrt`` on
ResNet-18), and names written up and to the right of every marker then covered each other. This is the one
placement both use: pure arithmetic on boxes in pixels, y pointing down (SVG's convention; matplotlib's display
coordinates are flipped by the caller).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Box", "LabelPlace", "names_by_point", "place_labels"]

Point = TypeVar("Point", bound=Hashable)

Box = tuple[float, float, float, float]
"""left, top, right, bottom, in pixels, y pointing down."""

NEAR_SPOTS = 4
"""The first spots (above right, below right, above left, below left) sit against the marker; a name placed
further away gets a line back to it."""


@dataclass(frozen=True)
class LabelPlace:
    """Where one name goes: its text's left end and baseline, and whether it sits away from its marker."""

    x: float
    y: float
    away: bool


def names_by_point(named: Iterable[tuple[str, Point]]) -> dict[Point, list[str]]:
    """The names drawn at each point, in the order given: plans that are one step are measured once and share
    their figures (``linear`` and ``nested`` often), and one label naming them all reads where two drawn on top
    of each other did not."""
    points: dict[Point, list[str]] = {}
    for name, point in named:
        points.setdefault(point, []).append(name)
    return points


def _overlap(a: Box, b: Box) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _within(box: Box, area: Box) -> bool:
    return area[0] <= box[0] and box[2] <= area[2] and area[1] <= box[1] and box[3] <= area[3]


def place_labels(points: Sequence[tuple[float, float]], widths: Sequence[float], *, area: Box,
                 height: float = 12.0, gap: float = 6.0, marker: float = 8.0) -> list[LabelPlace]:
    """A place for each point's name (``widths[i]`` pixels wide, ``height`` tall), in the order given.

    Names are placed top to bottom, each at the first spot whose box stays inside ``area`` and covers no name
    placed before it and no other point's marker (a square of ``marker`` pixels each side of its centre): above
    right, below right, above left, below left, then further up or down on the right, a line apart each time.
    Where no spot is free, the first (above right): a crowded picture still names every point.
    """
    markers = [(x - marker, y - marker, x + marker, y + marker) for x, y in points]
    placed: list[Box] = []
    places: list[LabelPlace | None] = [None] * len(points)
    for i in sorted(range(len(points)), key=lambda k: (points[k][1], points[k][0])):
        x, y = points[i]
        width = widths[i]
        above, below = y - gap, y + gap + height - 4
        spots = [(x + gap, above), (x + gap, below), (x - gap - width, above), (x - gap - width, below)]
        spots += [(x + gap, y + dy) for k in range(1, 5) for dy in (-gap - height * k, gap + height - 4 + height * k)]
        boxes = [(tx, ty - height + 2, tx + width, ty + 2) for tx, ty in spots]
        taken = placed + [m for k, m in enumerate(markers) if k != i]
        chosen = next((k for k, box in enumerate(boxes)
                       if _within(box, area) and not any(_overlap(box, other) for other in taken)), 0)
        placed.append(boxes[chosen])
        places[i] = LabelPlace(x=spots[chosen][0], y=spots[chosen][1], away=chosen >= NEAR_SPOTS)
    return [p for p in places if p is not None]
