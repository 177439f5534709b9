"""Pictures of a model's plans: ``remat-client show MODEL --plot memory.png``.

Two panels, from a ``ModelReport`` whose measurements carry a timeline (every measurement since CUDA ones
record one too):

1. activation memory over one training step (forward, then backward), for no checkpointing and for the
   chosen plan, each beside its predicted peak (dashed) — the measured curve is the CPU meter's level after
   every aten op, or on CUDA the bytes requested from the caching allocator after every alloc and free (its
   history), bucketed to at most 400 points keeping each bucket's highest level, so the peak is exact;
2. step-time overhead against measured peak for every algorithm: what each plan trades; with the Pareto
   frontier stored, its curve of (predicted peak, estimated recompute time) and its measured points — the
   plans ``--budget`` chooses from.

matplotlib with the Agg backend (no display needed); imported only here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from remat.client.errors import RematError
from remat.client.label_places import names_by_point, place_labels
from remat.client.report import ModelReport

__all__ = ["plot_report"]

MIB = 1024 * 1024
PLOT_FORMATS = ("png", "svg", "pdf")
"""The picture formats :func:`plot_report` writes, chosen by the file's suffix."""
LABEL_POINTS = 8
"""Font size of the plans' names on the trade panel."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise RematError("--plot needs matplotlib: `uv sync --extra plot` (or `pip install matplotlib`)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_report(report: ModelReport, path: str | Path, *, algorithm: str = "linear") -> Path:
    """Write the two-panel figure of ``report`` to ``path`` (PNG, SVG or PDF by its suffix).

    Raises:
        RematError: matplotlib missing, or the report has no measured timeline for ``none`` and ``algorithm``
            (stored before timelines were recorded): the message says what to run.
    """
    base, chosen = report.row("none"), report.row(algorithm)
    if base is None or chosen is None or base.timeline is None or chosen.timeline is None:
        raise RematError(f"no memory timeline stored for {report.request.name}'s none and {algorithm} plans "
                         f"(measurements stored before timelines were recorded have none): "
                         f"`remat-client plan {report.request.name} --refresh` "
                         f"measures them again")
    plt = _pyplot()
    fig, (memory, trade) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.7, 1]})
    for row, colour, label in ((base, "tab:red", "no checkpointing"), (chosen, "tab:blue", f"{algorithm} plan")):
        timeline = row.timeline
        ops = max(timeline["ops"], 1)
        x = [i / ops for i in timeline["op_index"]]
        y = [b / MIB for b in timeline["bytes"]]
        memory.step(x, y, where="post", color=colour, label=f"{label}: measured")
        memory.axhline(row.plan.predicted_peak_bytes / MIB, color=colour, linestyle="--", linewidth=1,
                       label=f"{label}: predicted peak {row.plan.predicted_peak_bytes / MIB:.1f} MiB")
        memory.axvline(timeline["backward_op"] / ops, color=colour, linestyle=":", linewidth=1)
    n_marks = len(chosen.plan.checkpoints)
    sample = chosen.timeline.get("sample", "aten op")
    memory.set_xlabel(f"progress through one training step ({sample}s, forward then backward; dotted: backward "
                      "starts)")
    memory.set_ylabel("activation memory (MiB" + (", requested from the allocator)" if sample != "aten op" else ")"))
    memory.set_title(f"{report.request.name}, input {list(report.request.input_shape)}, grads={report.request.grads}"
                     f" — {algorithm} keeps {n_marks} of {report.num_stages - 1} boundaries")
    memory.set_ylim(bottom=0)
    memory.set_xlim(0, 1)
    memory.legend(loc="upper left", fontsize=8)
    memory.grid(alpha=0.3)

    none_ms = base.step_ms
    named: list[tuple[float, float, str]] = []
    measured = names_by_point((row.plan.algorithm, (row.measured_peak_bytes, row.step_ms)) for row in report.rows
                              if row.measured_peak_bytes is not None and row.step_ms is not None)
    for (peak, step_ms), names in (measured.items() if none_ms else ()):
        overhead = 100 * (step_ms / none_ms - 1)
        trade.scatter(peak / MIB, overhead, s=40, color="tab:blue" if algorithm in names else "tab:gray")
        named.append((peak / MIB, overhead, ", ".join(names)))
    trade.margins(x=0.12, y=0.12)  # room for the labels of the outermost points inside the panel
    if report.frontier and none_ms:
        est_x = [r.plan.predicted_peak_bytes / MIB for r in report.frontier if r.plan.recompute_ms is not None]
        est_y = [100 * r.plan.recompute_ms / none_ms for r in report.frontier if r.plan.recompute_ms is not None]
        if est_x:
            trade.step(est_x, est_y, where="post", color="tab:green", linewidth=1,
                       label="budget frontier: predicted peak, estimated recompute")
        measured = [r for r in report.frontier if r.measured_peak_bytes is not None and r.step_ms is not None]
        if measured:
            trade.scatter([r.measured_peak_bytes / MIB for r in measured],
                          [100 * (r.step_ms / none_ms - 1) for r in measured], s=60, facecolors="none",
                          edgecolors="tab:green", label="budget frontier: measured")
        # Under the panel: inside it, the legend covered the labels of the plans in its corner.
        trade.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), fontsize=7, frameon=False)
    trade.set_xlabel("activation peak (MiB)")
    trade.set_ylabel("step-time overhead vs no checkpointing (%)")
    trade.set_title("what each plan trades")
    trade.grid(alpha=0.3)
    fig.tight_layout()
    _name_points(fig, trade, named)  # after the layout: the places are worked out in its pixels
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _name_points(fig: Any, axes: Any, named: list[tuple[float, float, str]]) -> None:
    """Write each point's name where it covers no other name or marker and stays inside the panel
    (:func:`remat.client.label_places.place_labels`, with the names' widths as the renderer measures them), with a
    thin line back to the point where the name had to go further away."""
    if not named:
        return
    from matplotlib.font_manager import FontProperties

    renderer = fig.canvas.get_renderer()
    font = FontProperties(size=LABEL_POINTS)
    top = fig.bbox.height  # display coordinates count y up; the placement counts it down
    pixels = [(px, top - py) for px, py in axes.transData.transform([(x, y) for x, y, _ in named])]
    widths = [renderer.get_text_width_height_descent(name, font, ismath=False)[0] for *_, name in named]
    _, height, descent = renderer.get_text_width_height_descent("Ag", font, ismath=False)
    box = axes.bbox
    places = place_labels(pixels, widths, area=(box.x0, top - box.y1, box.x1, top - box.y0), height=height + descent)
    points_per_pixel = 72 / fig.dpi  # offsets in points keep their place when savefig draws at another dpi
    for (x, y, name), (px, py), place in zip(named, pixels, places, strict=True):
        axes.annotate(name, (x, y), textcoords="offset points", fontsize=LABEL_POINTS,
                      xytext=((place.x - px) * points_per_pixel, (py - place.y) * points_per_pixel),
                      arrowprops={"arrowstyle": "-", "color": "0.6", "linewidth": 0.6} if place.away else None)
