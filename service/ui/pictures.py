"""The two pictures of a plan key's page, drawn from stored records as SVG, and the cache that keeps them.

- memory over one measured training step, for no checkpointing and for the chosen plan, each beside its
  predicted peak (dashed), and where backward starts (dotted): the measurement's timeline (``extra
  ["timeline"]``, at most 400 buckets each keeping its highest level, so the peak is exact);
- the time–memory trade: every registered plan's measured peak against its measured step-time overhead, the
  key's Pareto frontier as estimated (predicted peak, estimated recompute time) and its measured points.

The same two panels as ``remat-client show --plot`` (client/plots.py, matplotlib), drawn here without it: the
API server does not load matplotlib, an optional extra. A picture depends only on the key's plans and their
measurements, so :class:`PictureCache` keeps it under ``repository.key_version`` and a page reload neither
reads the timelines again nor draws anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from remat.client.label_places import names_by_point
from remat.client.report import BASELINE_ALGORITHM
from remat.service.lru import LruCache
from remat.service.records import PlanRecord
from remat.service.ui.svg import Figure, empty_figure

__all__ = ["PictureCache", "frontier_picture", "timeline_picture"]

MIB = 1024 * 1024
NONE_COLOUR = "#c0392b"
PLAN_COLOUR = "#1f6fb4"
FRONTIER_COLOUR = "#2e8b57"
OTHER_COLOUR = "#8a8a8a"


def _mib(n: float) -> float:
    return n / MIB


def _timeline_of(record: PlanRecord | None) -> dict[str, Any] | None:
    measured = record.timeline_measurement if record is not None else None
    return dict(measured.extra["timeline"]) if measured is not None else None


def timeline_picture(base: PlanRecord | None, chosen: PlanRecord) -> str:
    """Memory over one training step with no checkpointing and with ``chosen``'s plan (``base`` is the key's
    ``none`` plan; when it has no timeline of its own, the chosen measurement's baseline run stands for it)."""
    algorithm = chosen.plan.algorithm
    title = f"Memory over one training step: none vs {algorithm}"
    chosen_timeline = _timeline_of(chosen)
    if chosen_timeline is None:
        return empty_figure(title, f"The {algorithm} plan's measurements carry no timeline (stored before "
                                   f"timelines were recorded); profiling the model again records one.")
    base_timeline = _timeline_of(base)
    if base_timeline is None and chosen.timeline_measurement is not None:
        base_timeline = chosen.timeline_measurement.extra.get("baseline_timeline")
    series = [(chosen_timeline, PLAN_COLOUR, f"{algorithm} plan", chosen.plan.predicted_peak_bytes)]
    if base_timeline is not None and algorithm != BASELINE_ALGORITHM:
        series.insert(0, (base_timeline, NONE_COLOUR, "no checkpointing",
                          base.plan.predicted_peak_bytes if base is not None else None))
    top = max(max((max(t["bytes"], default=0) for t, *_ in series), default=0),
              max((p or 0 for *_, p in series), default=0))
    sample = chosen_timeline.get("sample", "aten op")
    unit = "MiB requested from the allocator" if sample != "aten op" else "MiB"
    figure = Figure(title=title, x_label=f"progress through one step ({sample}s: forward, then backward; "
                                         f"dotted: backward starts)",
                    y_label=f"activation memory ({unit})", x_range=(0.0, 1.0), y_range=(0.0, _mib(top) * 1.08),
                    description=f"Activation memory over one measured training step of {chosen.key.model_hash}, "
                                f"without checkpointing and with the {algorithm} plan, beside the predicted peaks.")
    for timeline, colour, label, predicted in series:
        ops = max(int(timeline["ops"]), 1)
        xs = [i / ops for i in timeline["op_index"]]
        ys = [_mib(b) for b in timeline["bytes"]]
        if xs:
            xs.append(1.0)
            ys.append(ys[-1])
        peak = max(timeline["bytes"], default=0)
        figure.step(xs, ys, colour=colour, label=f"{label}: measured, peak {_mib(peak):.1f} MiB")
        if predicted is not None:
            figure.hline(_mib(predicted), colour=colour, label=f"predicted {_mib(predicted):.1f} MiB")
        figure.vline(int(timeline["backward_op"]) / ops, colour=colour)
    return figure.svg()


def frontier_picture(plans: Sequence[PlanRecord], frontier: Sequence[PlanRecord], *, chosen: str) -> str:
    """Step-time overhead against activation peak: each registered plan as measured (``chosen`` in blue), and the
    frontier as estimated (a step line) and as measured (hollow points). Overheads are against the ``none``
    plan's measured step; the estimate's is the estimated recompute time over that step (as ``show --plot``)."""
    title = "Time–memory trade: step-time overhead against activation peak"
    base = next((r for r in plans if r.plan.algorithm == BASELINE_ALGORITHM and not r.plan.budget_bytes), None)
    none_ms = base.measurements[0].step_ms if base is not None and base.measurements else None

    def overhead(step_ms: float | None) -> float | None:
        return 100 * (step_ms / none_ms - 1) if step_ms is not None and none_ms else None

    measured = [(r.plan.algorithm, _mib(r.measurements[0].measured_peak_bytes), overhead(r.measurements[0].step_ms))
                for r in plans if not r.plan.budget_bytes and r.measurements
                and r.measurements[0].measured_peak_bytes is not None]
    measured = [(name, x, y) for name, x, y in measured if y is not None]
    estimated = []
    for r in frontier:
        if r.plan.recompute_ms is None:
            continue
        share = (r.plan.recompute_ms / none_ms if none_ms else r.plan.recompute_overhead)
        if share is not None:
            estimated.append((_mib(r.plan.predicted_peak_bytes), 100 * share))
    frontier_measured = [(_mib(m.measured_peak_bytes), overhead(m.step_ms)) for r in frontier if r.measurements
                         for m in r.measurements[:1] if m.measured_peak_bytes is not None]
    frontier_measured = [(x, y) for x, y in frontier_measured if y is not None]
    if not measured and not estimated:
        return empty_figure(title, "Nothing to draw: no plan of this key is measured and no frontier is stored.")
    xs = [x for _, x, _ in measured] + [x for x, _ in estimated] + [x for x, _ in frontier_measured]
    ys = [y for *_, y in measured] + [y for _, y in estimated] + [y for _, y in frontier_measured]
    low = min(0.0, min(ys))
    figure = Figure(title=title, x_label="activation peak (MiB)",
                    y_label="step-time overhead vs none (%)", x_range=(0.0, max(xs) * 1.1),
                    y_range=(low * 1.1, max(max(ys) * 1.15, 1.0)),
                    description="Each plan's measured activation peak against its measured step-time overhead, "
                                "and the Pareto frontier of predicted peak against estimated recompute time.")
    if estimated:
        estimated.sort()
        figure.step([x for x, _ in estimated], [y for _, y in estimated], colour=FRONTIER_COLOUR, width=1.2,
                    label="frontier: predicted peak, estimated recompute")
    if frontier_measured:
        figure.points([x for x, _ in frontier_measured], [y for _, y in frontier_measured], colour=FRONTIER_COLOUR,
                      hollow=True, radius=5.5, label="frontier: measured")
    by_point = names_by_point((name, (x, y)) for name, x, y in measured)
    points = [(", ".join(names), x, y, chosen in names) for (x, y), names in by_point.items()]
    others = [(n, x, y) for n, x, y, is_chosen in points if not is_chosen]
    if others:
        figure.points([x for _, x, _ in others], [y for *_, y in others], colour=OTHER_COLOUR,
                      names=[n for n, *_ in others], label="plans: measured")
    mine = [(n, x, y) for n, x, y, is_chosen in points if is_chosen]
    if mine:
        figure.points([x for _, x, _ in mine], [y for *_, y in mine], colour=PLAN_COLOUR,
                      names=[n for n, *_ in mine], label=f"{chosen}: measured")
    return figure.svg()


class PictureCache(LruCache[str]):
    """Drawn pictures under a name that includes the version of the rows they were drawn from."""

    def __init__(self, size: int = 256) -> None:
        super().__init__(size)
