"""What every ``remat-client`` command shares: the one-line input error (exit 2), JSON output, byte
formatting, the zoo-model options and the request they make, the progress bar on stderr, and the model table
that ``plan``, ``status`` and ``show`` all print.

Kept apart from ``cli.py`` so that each command group in its own module (``cli_plan.py``, ``cli_jobs.py``,
``cli_show.py``, ``zoo_command.py``) uses the same conventions without importing the CLI that registers it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import click

from remat.client.derived_trace import describe_derivation
from remat.client.devices import DEVICES
from remat.client.errors import RematError
from remat.client.hf_models import DEFAULT_CPU_SEQ_LEN, DEFAULT_CUDA_SEQ_LEN, MAX_SEQ_LEN
from remat.client.plan import CERTIFIED_BY_KEY, LOWER_BOUND_AT_KEY
from remat.client.precision import PRECISIONS
from remat.client.request import DEFAULT_CPU_BATCH, DEFAULT_CPU_RESOLUTION, DEFAULT_CUDA_BATCH

if TYPE_CHECKING:
    from remat.client.plan import Plan

__all__ = ["ENVIRONMENT_BEFORE_CONFIG", "InputError", "OutputFile", "emit_json", "fail_input", "format_bytes",
           "format_checkpoints", "format_kept", "model_kwargs_option", "model_options", "model_request", "parse_shape",
           "print_model_table", "run_with_progress", "server_or_fail"]

ENVIRONMENT_BEFORE_CONFIG: dict[str, str] = {}
"""The environment as ``main()`` found it, before the config file fed the ``REMAT_*`` layer: ``config show``
tells an env setting from a file one by it. Here rather than in ``cli.py`` so that the command module reading it
never imports ``cli.py`` (under ``python -m remat.client.cli`` that would be a second copy with its own dict)."""


class InputError(click.ClickException):
    """Bad user input: reported on one line with exit code 2."""

    exit_code = 2


class OutputFile(click.ParamType):
    """A file a command writes once its work is done (``trace --out``, ``show --plot``, ``zoo --csv``).

    Checked when the command line is read: a directory that does not exist or cannot be written, or a
    picture format that cannot be drawn, used to surface as a traceback's last line (exit 1) after the
    profile or the whole zoo run it was to hold. ``-`` is standard output where ``stdout`` allows it.
    """

    name = "file"

    def __init__(self, *, stdout: bool = False, suffixes: Sequence[str] | None = None) -> None:
        self.stdout = stdout
        self.suffixes = tuple(suffixes) if suffixes is not None else None

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        import os
        from pathlib import Path

        text = str(value)
        if self.stdout and text == "-":
            return text
        path = Path(text).expanduser()
        if self.suffixes is not None and path.suffix.lower().lstrip(".") not in self.suffixes:
            self.fail(f"{text!r} must end in {', '.join('.' + s for s in self.suffixes)}", param, ctx)
        if path.is_dir():
            self.fail(f"{text!r} is a directory", param, ctx)
        folder = path.parent
        if not folder.is_dir():
            self.fail(f"{text!r}: no directory {str(folder)!r} to write it in", param, ctx)
        if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
            self.fail(f"{text!r} cannot be written here (permissions)", param, ctx)
        return str(path)


def fail_input(message: str) -> NoReturn:
    raise InputError(message)


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2))


def format_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def model_options(fn: Any) -> Any:
    """Options shared by the commands that take a MODEL (and by ``zoo``, for each of its models)."""
    for option in reversed((
        click.option("--batch-size", type=click.IntRange(min=1), default=None,
                     help=f"Batch size (default {DEFAULT_CPU_BATCH} on cpu, {DEFAULT_CUDA_BATCH} on cuda)."),
        click.option("--input-shape", default=None, metavar="C,H,W",
                     help=f"One sample's shape (default: the model's, at {DEFAULT_CPU_RESOLUTION} px on cpu)."),
        click.option("--seq-len", type=click.IntRange(min=1, max=MAX_SEQ_LEN), default=None, metavar="N",
                     help=f"Tokens per sample of an hf: token model (default {DEFAULT_CPU_SEQ_LEN} on cpu, "
                          f"{DEFAULT_CUDA_SEQ_LEN} on cuda); instead of --input-shape."),
        click.option("--device", type=click.Choice(DEVICES), default="cpu", show_default=True),
        click.option("--grads", type=click.Choice(["none", "kept"]), default="none", show_default=True,
                     help="Gradients set to None between steps (zero_grad's default) or kept allocated."),
        click.option("--dtype", type=click.Choice(PRECISIONS), default="float32", show_default=True,
                     help="Precision: the model in this dtype, or autocast_* (float32 weights, forward under "
                          "torch.autocast)."),
    )):
        fn = option(fn)
    return fn


def model_kwargs_option(fn: Any) -> Any:
    """``--model-kwargs JSON`` for the commands that build one MODEL."""
    return click.option("--model-kwargs", "model_kwargs", default=None, metavar="JSON",
                        help="Keyword arguments for MODEL's builder, a JSON object: '{\"num_classes\": 10}'; for "
                             "an hf: model, fields of its configuration: '{\"n_layer\": 6}'.")(fn)


def parse_shape(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        fail_input(f"--input-shape: {text!r} is not comma-separated integers (e.g. 3,224,224)")
    if not shape or any(d < 1 for d in shape):
        fail_input(f"--input-shape: every dimension must be ≥ 1, got {text!r}")
    return shape


def model_request(model: str, batch_size: int | None, input_shape: str | None, device: str, grads: str,
                  dtype: str = "float32", model_kwargs: str | None = None, seq_len: int | None = None) -> Any:
    """The ``ModelRequest`` of a command's MODEL and options; a bad one exits 2 with one line."""
    from remat.client.model_spec import parse_model_kwargs
    from remat.client.request import default_request

    sample_shape = parse_shape(input_shape)
    try:
        return default_request(model, batch_size=batch_size, sample_shape=sample_shape, device=device, grads=grads,
                               dtype=dtype, model_kwargs=parse_model_kwargs(model_kwargs), seq_len=seq_len)
    except RematError as exc:
        fail_input(str(exc))


def run_with_progress(work: Any, as_json: bool) -> Any:
    """Run ``work(progress)`` with a progress bar on stderr (none in --json mode or when stderr is no terminal:
    a bar drawn into a pipe would leave a blank line before any error message)."""
    if as_json or not sys.stderr.isatty():
        return work(None)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description:<28}"), BarColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("starting", total=1.0)

        def progress(message: str, fraction: float) -> None:
            bar.update(task, description=message, completed=fraction)

        return work(progress)


def server_or_fail(server: str | None) -> str:
    if not server:
        fail_input("--server URL (or REMAT_SERVER) is needed: jobs run on a remat service's workers")
    return server


def format_checkpoints(checkpoints: Sequence[int], limit: int = 12) -> str:
    """A chain plan's boundaries, cut after ``limit`` so that a deep model's plan keeps its table readable."""
    if not checkpoints:
        return "-"
    shown = ",".join(str(c) for c in checkpoints[:limit])
    return shown + (f",… ({len(checkpoints)})" if len(checkpoints) > limit else "")


def format_algorithm(plan: Plan) -> str:
    """The algorithm column: a budget point that is a registered planner's plan says whose (``budget (acg)``)."""
    return plan.algorithm if plan.planned_by == plan.algorithm else f"{plan.algorithm} ({plan.planned_by})"


def format_kept(plan: Plan) -> str:
    """The checkpoints column: a chain plan's boundaries (said to run nested for a nested plan), or what a graph
    plan recomputes."""
    if plan.dropped_vertices is not None:
        return f"graph: recomputes {len(plan.dropped_vertices)} of {plan.num_vertices} vertices"
    if plan.nested:
        return f"nested: {format_checkpoints(plan.checkpoints)}"
    return format_checkpoints(plan.checkpoints)


def _same_step(base: Any, row: Any) -> bool:
    """Whether ``row``'s plan is ``none``'s very training step (a chain plan that keeps every boundary, as
    ``none`` does) measured as one with it (NOTE [ one step, one measurement ] in remat.worker.pipeline): its
    time is ``none``'s, neither an overhead nor noise."""
    plan = row.plan
    return (not plan.is_graph_plan and not plan.nested and tuple(plan.checkpoints) == tuple(base.plan.checkpoints)
            and row.step_ms == base.step_ms)


def print_model_table(report: Any, source: str | None = None) -> None:
    """The model's plans beside their measurements; ``source`` says where the answer came from."""
    from rich.console import Console
    from rich.table import Table

    req = report.request
    derived = getattr(report, "derived_from", ())
    source = source or ("from the plan store" if report.from_store else
                        f"derived from {describe_derivation(getattr(report, 'derived_along', None), derived)} and "
                        f"measured now" if derived
                        else "profiled and measured now")
    title = (f"{req.name} — input {list(req.input_shape)} {req.dtype}, {req.device}"
             f"{f' ({report.device_name})' if report.device_name else ''}, grads={req.grads}, "
             f"{report.num_stages} stages, {source}")
    table = Table(title=title)
    columns = ("algorithm", "checkpoints", "predicted peak", "measured peak", "saving vs none", "step time")
    for column in columns:
        table.add_column(column, justify="left" if column in ("algorithm", "checkpoints") else "right")
    base = report.row("none")
    for row in report.rows:
        saving = "-"
        if base and base.measured_peak_bytes and row.measured_peak_bytes is not None:
            saving = f"{1 - row.measured_peak_bytes / base.measured_peak_bytes:.1%}"
        step = "-" if row.step_ms is None else f"{row.step_ms:.0f} ms"
        if base and base.step_ms and row.step_ms is not None and row is not base:
            from remat.client.report import Trade

            if _same_step(base, row):
                step += " (none's step)"
            else:
                trade = Trade.of(base, row)
                step += " (within noise)" if trade.within_noise else f" ({row.step_ms / base.step_ms - 1:+.0%})"
        predicted = format_bytes(row.plan.predicted_peak_bytes)
        if row.plan.cost_model != "pytorch":  # not the measured quantity: say which model it is
            predicted += f" ({row.plan.cost_model})"
        table.add_row(format_algorithm(row.plan), format_kept(row.plan), predicted,
                      format_bytes(row.measured_peak_bytes), saving, step)
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    click.echo("Peaks are activation memory of one training step (weights and the input batch excluded); "
               "the step time's change against none is the recompute overhead (each plan's step read against the "
               "none steps run just before and after it, the median of interleaved rounds; within noise: no larger "
               "than the rounds' spread; none's step: a plan that keeps everything, measured as none).")
    bounded = [row.plan for row in report.rows if row.plan.lower_bound_bytes is not None]
    if bounded:
        best = min(bounded, key=lambda p: p.predicted_peak_bytes)
        click.echo(f"No plan of this step can peak below {format_bytes(best.lower_bound_bytes)}, what the step "
                   f"itself needs ({best.extra.get(LOWER_BOUND_AT_KEY, 'one event')}): none can peak more than "
                   f"{best.optimality_gap:.0%} below {best.planned_by}'s.")
        if best.certified_bound_bytes is not None:
            click.echo(f"No one-level graph plan can peak below {format_bytes(best.certified_bound_bytes)} "
                       f"({best.extra.get(CERTIFIED_BY_KEY)}): none is more than {best.certified_gap:.0%} below "
                       f"{best.planned_by}'s.")
    if report.frontier:
        low, high = report.frontier[0].plan.predicted_peak_bytes, report.frontier[-1].plan.predicted_peak_bytes
        measured = sum(1 for r in report.frontier if r.measured_peak_bytes is not None)
        if len(report.frontier) == 1:  # no trade: every other plan is slower for no less memory
            click.echo(f"Time-memory frontier: one plan, {format_bytes(low)} "
                       f"({'measured' if measured else 'not measured'}); no plan trades step time for memory here.")
        else:
            click.echo(f"Time-memory frontier: {len(report.frontier)} plans from {format_bytes(low)} to "
                       f"{format_bytes(high)} ({measured} measured); --budget SIZE picks the fastest that fits.")
