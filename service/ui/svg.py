"""A small SVG chart builder: linear axes, step and straight lines, points, reference lines, a legend.

The web pages draw two kinds of picture (memory over one training step, the time–memory frontier) on the
server, where matplotlib is an optional extra the API server does not load, and a browser on an offline cluster
can fetch nothing from a CDN. This is what those pictures need and no more: every text is escaped, every
coordinate is rounded to a tenth of a pixel (a 400-sample timeline stays a few kilobytes), and colours are
presentation attributes rather than a ``<style>`` element, so the document shows under a strict
``Content-Security-Policy`` (``default-src 'none'``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape

from remat.client.label_places import place_labels

__all__ = ["Figure", "empty_figure", "nice_ticks"]

FONT = "system-ui, -apple-system, 'Segoe UI', sans-serif"


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values (1, 2 or 5 times a power of ten apart) covering ``[low, high]``."""
    if not math.isfinite(low) or not math.isfinite(high) or high <= low:
        return [low]
    raw = (high - low) / max(count, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(low / step - 1e-9) * step
    ticks = []
    value = first
    while value <= high + step * 1e-9:
        ticks.append(0.0 if abs(value) < step * 1e-9 else value)
        value += step
    return ticks


def _label(value: float) -> str:
    text = f"{value:.6g}"
    return text if "e" not in text else f"{value:.2g}"


def _n(value: float) -> str:
    """A coordinate: a tenth of a pixel is finer than any screen shows."""
    return f"{value:.1f}".rstrip("0").rstrip(".")


@dataclass
class _Entry:
    label: str
    colour: str
    kind: str  # "line", "dash", "dot", "point", "hollow"


@dataclass
class Figure:
    """One chart: data coordinates ``x_range`` × ``y_range`` mapped onto a ``width`` × ``height`` SVG."""

    title: str
    x_label: str
    y_label: str
    x_range: tuple[float, float]
    y_range: tuple[float, float]
    width: int = 760
    height: int = 360
    description: str = ""
    """Read by screen readers (the SVG's ``<desc>``): what the picture shows, in words."""
    left: int = 64
    right: int = 16
    top: int = 34
    bottom: int = 88
    _body: list[str] = field(default_factory=list)
    _legend: list[_Entry] = field(default_factory=list)
    _names: list[tuple[float, float, str]] = field(default_factory=list)
    """Every named marker's centre (pixels) and name: placed together at the end (:meth:`_name_marks`)."""

    def __post_init__(self) -> None:
        x0, x1 = self.x_range
        y0, y1 = self.y_range
        self.x_range = (x0, x1 if x1 > x0 else x0 + 1.0)
        self.y_range = (y0, y1 if y1 > y0 else y0 + 1.0)

    # --- coordinates --------------------------------------------------------------------------------------

    def px(self, x: float) -> float:
        x0, x1 = self.x_range
        return self.left + (x - x0) / (x1 - x0) * (self.width - self.left - self.right)

    def py(self, y: float) -> float:
        y0, y1 = self.y_range
        return self.height - self.bottom - (y - y0) / (y1 - y0) * (self.height - self.top - self.bottom)

    # --- marks --------------------------------------------------------------------------------------------

    def step(self, xs: Sequence[float], ys: Sequence[float], *, colour: str, label: str | None = None,
             width: float = 1.6) -> None:
        """A step line holding each value until the next x (matplotlib's ``where="post"``); the last point ends
        it (repeat the last value at the end of the range to draw its level there)."""
        if not xs:
            return
        parts = [f"M{_n(self.px(xs[0]))} {_n(self.py(ys[0]))}"]
        for x, y in zip(xs[1:], ys[1:], strict=True):
            parts.append(f"H{_n(self.px(x))}V{_n(self.py(y))}")
        self._body.append(f'<path d="{"".join(parts)}" fill="none" stroke="{colour}" stroke-width="{width}" '
                          f'stroke-linejoin="round"/>')
        if label:
            self._legend.append(_Entry(label, colour, "line"))

    def hline(self, y: float, *, colour: str, label: str | None = None, dash: str = "6 4") -> None:
        """A horizontal reference line across the plot (a predicted peak)."""
        self._body.append(f'<line x1="{self.left}" x2="{self.width - self.right}" y1="{_n(self.py(y))}" '
                          f'y2="{_n(self.py(y))}" stroke="{colour}" stroke-width="1" stroke-dasharray="{dash}"/>')
        if label:
            self._legend.append(_Entry(label, colour, "dash"))

    def vline(self, x: float, *, colour: str, label: str | None = None) -> None:
        """A vertical dotted line (where backward starts)."""
        self._body.append(f'<line x1="{_n(self.px(x))}" x2="{_n(self.px(x))}" y1="{self.top}" '
                          f'y2="{self.height - self.bottom}" stroke="{colour}" stroke-width="1" '
                          f'stroke-dasharray="2 3"/>')
        if label:
            self._legend.append(_Entry(label, colour, "dot"))

    def points(self, xs: Sequence[float], ys: Sequence[float], *, colour: str, label: str | None = None,
               names: Sequence[str] | None = None, hollow: bool = False, radius: float = 4.0) -> None:
        """Markers, each with a tooltip (``<title>``) and, with ``names``, a small text beside it."""
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            fill = "none" if hollow else colour
            name = names[i] if names else None
            tip = f"<title>{escape(name)}</title>" if name else ""
            self._body.append(f'<circle cx="{_n(self.px(x))}" cy="{_n(self.py(y))}" r="{radius}" fill="{fill}" '
                              f'stroke="{colour}" stroke-width="1.5">{tip}</circle>')
            if name:
                self._names.append((self.px(x), self.py(y), name))
        if label:
            self._legend.append(_Entry(label, colour, "hollow" if hollow else "point"))

    # --- the document -------------------------------------------------------------------------------------

    def _name_marks(self) -> list[str]:
        """Each marker's name beside it, where it covers no other name or marker and stays inside the plot
        (:func:`remat.client.label_places.place_labels`; widths estimated at 6.2 px a character of 11 px, as the
        legend does), with a thin line back to its marker where it had to go further away."""
        area = (float(self.left), float(self.top), float(self.width - self.right), float(self.height - self.bottom))
        places = place_labels([(x, y) for x, y, _ in self._names], [6.2 * len(n) for *_, n in self._names], area=area)
        out = []
        for (x, y, name), place in zip(self._names, places, strict=True):
            if place.away:
                out.append(f'<line x1="{_n(x)}" y1="{_n(y)}" x2="{_n(place.x)}" y2="{_n(place.y - 4)}" '
                           f'stroke="#999" stroke-width="0.8"/>')
            out.append(f'<text x="{_n(place.x)}" y="{_n(place.y)}" font-size="11" fill="#333">{escape(name)}</text>')
        return out

    def _axes(self) -> list[str]:
        out = []
        bottom, right = self.height - self.bottom, self.width - self.right
        for y in nice_ticks(*self.y_range):
            py = _n(self.py(y))
            out.append(f'<line x1="{self.left}" x2="{right}" y1="{py}" y2="{py}" stroke="#e4e4e4"/>')
            out.append(f'<text x="{self.left - 6}" y="{py}" dy="0.32em" text-anchor="end" font-size="11" '
                       f'fill="#444">{escape(_label(y))}</text>')
        for x in nice_ticks(*self.x_range, count=8):
            px = _n(self.px(x))
            out.append(f'<line x1="{px}" x2="{px}" y1="{self.top}" y2="{bottom}" stroke="#f0f0f0"/>')
            out.append(f'<text x="{px}" y="{bottom + 16}" text-anchor="middle" font-size="11" '
                       f'fill="#444">{escape(_label(x))}</text>')
        out.append(f'<rect x="{self.left}" y="{self.top}" width="{right - self.left}" height="{bottom - self.top}" '
                   f'fill="none" stroke="#888"/>')
        out.append(f'<text x="{(self.left + right) / 2:.1f}" y="{bottom + 34}" text-anchor="middle" '
                   f'font-size="12" fill="#222">{escape(self.x_label)}</text>')
        mid = (self.top + bottom) / 2
        out.append(f'<text transform="translate(14 {mid:.1f}) rotate(-90)" text-anchor="middle" font-size="12" '
                   f'fill="#222">{escape(self.y_label)}</text>')
        out.append(f'<text x="{self.left}" y="20" font-size="13" font-weight="600" fill="#111">'
                   f'{escape(self.title)}</text>')
        return out

    def _legend_marks(self) -> list[str]:
        """The legend under the x axis's label, in rows as wide as the figure."""
        out = []
        x, y = float(self.left), float(self.height - self.bottom + 56)
        for entry in self._legend:
            needed = 30 + 6.2 * len(entry.label)
            if x > self.left and x + needed > self.width - self.right:
                x, y = float(self.left), y + 16
            if entry.kind in ("line", "dash", "dot"):
                dash = {"line": "", "dash": ' stroke-dasharray="6 4"', "dot": ' stroke-dasharray="2 3"'}[entry.kind]
                out.append(f'<line x1="{_n(x)}" x2="{_n(x + 18)}" y1="{_n(y - 4)}" y2="{_n(y - 4)}" '
                           f'stroke="{entry.colour}" stroke-width="2"{dash}/>')
            else:
                fill = "none" if entry.kind == "hollow" else entry.colour
                out.append(f'<circle cx="{_n(x + 9)}" cy="{_n(y - 4)}" r="4" fill="{fill}" '
                           f'stroke="{entry.colour}" stroke-width="1.5"/>')
            out.append(f'<text x="{_n(x + 23)}" y="{_n(y)}" font-size="11" fill="#222">{escape(entry.label)}</text>')
            x += needed
        return out

    def svg(self) -> str:
        """The standalone SVG document."""
        desc = f"<desc>{escape(self.description)}</desc>" if self.description else ""
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{self.height}" '
                f'viewBox="0 0 {self.width} {self.height}" role="img" font-family="{escape(FONT)}">'
                f"<title>{escape(self.title)}</title>{desc}"
                f'<rect width="{self.width}" height="{self.height}" fill="#fff"/>'
                + "".join(self._axes()) + "".join(self._body) + "".join(self._name_marks())
                + "".join(self._legend_marks()) + "</svg>")


def empty_figure(title: str, message: str) -> str:
    """A picture that says why there is nothing to draw (a ``<img>`` keeps its place and its alt text)."""
    figure = Figure(title=title, x_label="", y_label="", x_range=(0, 1), y_range=(0, 1), height=120, bottom=20,
                    description=message)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{figure.width}" height="{figure.height}" '
            f'viewBox="0 0 {figure.width} {figure.height}" role="img" font-family="{escape(FONT)}">'
            f"<title>{escape(title)}</title><desc>{escape(message)}</desc>"
            f'<rect width="{figure.width}" height="{figure.height}" fill="#fafafa" stroke="#ccc"/>'
            f'<text x="16" y="28" font-size="13" font-weight="600" fill="#111">{escape(title)}</text>'
            f'<text x="16" y="60" font-size="12" fill="#444">{escape(message)}</text></svg>')
