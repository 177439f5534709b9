"""``remat-client``: plan, evaluate, trace and measure from the command line.

Exit codes (design.md contract): 0 success, 2 bad input (one line on stderr, no traceback), 1 anything else.
Planning from a trace file never imports torch, so ``remat-client plan --trace`` starts in a fraction of a
second; the model commands load torch and the worker lazily.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import click
from remat.client.errors import RematError
from remat.client.plan import COST_MODELS, Plan
from remat.client.trace import Trace, load_trace

PROG = "remat-client"


class InputError(click.ClickException):
    """Bad user input: reported on one line with exit code 2."""

    exit_code = 2


def _fail_input(message: str) -> NoReturn:
    raise InputError(message)


def _emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2))


def _format_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _format_checkpoints(checkpoints: Sequence[int], limit: int = 12) -> str:
    if not checkpoints:
        return "-"
    shown = ",".join(str(c) for c in checkpoints[:limit])
    return shown + (f",… ({len(checkpoints)})" if len(checkpoints) > limit else "")


def _print_plan_table(plans: Sequence[Plan], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in ("algorithm", "checkpoints", "cost model", "predicted peak", "saving vs none", "recompute"):
        table.add_column(column, justify="left" if column in ("algorithm", "checkpoints", "cost model") else "right")
    for p in plans:
        overhead = p.recompute_overhead
        recompute = "-" if p.recompute_ms is None else f"{p.recompute_ms:.1f} ms"
        if overhead is not None:
            recompute += f" (+{overhead:.0%})"
        table.add_row(p.algorithm, _format_checkpoints(p.checkpoints), p.cost_model, _format_bytes(p.predicted_peak_bytes),
                      f"{p.saving:.1%}", recompute)
    # A pipe gets no terminal width; 80 columns would truncate the checkpoint lists.
    Console(width=None if sys.stdout.isatty() else 140).print(table)


def _load_trace_or_fail(path: str) -> Trace:
    try:
        return load_trace(path)
    except RematError as exc:
        _fail_input(f"{path}: {exc}")


def _algorithms(name: str) -> list[str]:
    from remat.worker.planners import PLANNERS

    if name == "all":
        return list(PLANNERS)
    if name not in PLANNERS:
        _fail_input(f"--algorithm: {name!r} is unknown; choose one of {', '.join(PLANNERS)} or all")
    return [name]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="remat", prog_name=PROG)
def cli() -> None:
    """remat: measured activation-checkpointing plans for PyTorch training."""


@cli.command("plan")
@click.argument("model", required=False)
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), help="Plan from a remat-trace/1 file.")
@click.option("--algorithm", default="all", show_default=True, help="Planner name, or all.")
@click.option("--cost-model", type=click.Choice(COST_MODELS), default=None,
              help="Report every plan under this model (default: each planner's own).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def plan_command(model: str | None, trace_path: str | None, algorithm: str, cost_model: str | None,
                 as_json: bool) -> None:
    """Plan checkpoints for MODEL (a zoo name) or for a trace file."""
    if model is not None and trace_path is not None:
        _fail_input("give either MODEL or --trace FILE, not both")
    if trace_path is None:
        _fail_input("give a zoo MODEL or --trace FILE")
    trace = _load_trace_or_fail(trace_path)
    names = _algorithms(algorithm)
    from remat.worker.planning import plan_all

    plans = plan_all(trace, cost_model=cost_model, algorithms=names)
    if as_json:
        _emit_json(plans[0].to_dict() if algorithm != "all" else {"plans": [p.to_dict() for p in plans]})
    else:
        label = trace.metadata.get("model") or Path(trace_path).name
        _print_plan_table(plans, f"{label}: {trace.num_stages} stages")


def _read_checkpoint_sets(path: str, num_stages: int) -> list[tuple[int, ...]]:
    """One plan per line, comma-separated boundaries; an empty line is the empty plan."""
    from remat.client.plan import validate_checkpoints

    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        _fail_input(f"--checkpoints-file {path!r}: cannot be read ({exc})")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line does not start another plan
    sets = []
    for lineno, line in enumerate(lines, start=1):
        fields = [f.strip() for f in line.split(",")] if line.strip() else []
        try:
            values = [int(f) for f in fields]
            sets.append(validate_checkpoints(values, num_stages))
        except ValueError as exc:
            detail = str(exc) if isinstance(exc, RematError) else f"{line!r} is not a comma-separated list of integers"
            _fail_input(f"{path}:{lineno}: {detail}")
    return sets


@cli.command("evaluate")
@click.option("--trace", "trace_path", required=True, type=click.Path(dir_okay=False))
@click.option("--cost-model", type=click.Choice(COST_MODELS), required=True)
@click.option("--checkpoints-file", required=True, type=click.Path(dir_okay=False),
              help="One plan per line: comma-separated boundaries; an empty line for no checkpoints.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def evaluate_command(trace_path: str, cost_model: str, checkpoints_file: str, as_json: bool) -> None:
    """Predicted peak of given checkpoint sets under a cost model."""
    trace = _load_trace_or_fail(trace_path)
    sets = _read_checkpoint_sets(checkpoints_file, trace.num_stages)
    from remat.worker.cost_models import peak

    peaks = [peak(trace, s, cost_model) for s in sets]
    if as_json:
        _emit_json({"cost_model": cost_model, "peaks": peaks})
    else:
        for s, p in zip(sets, peaks, strict=True):
            click.echo(f"{_format_bytes(p):>12}  {_format_checkpoints(s, limit=1000)}")


def _one_line(message: str) -> str:
    """Click spreads some messages (choices, usage) over lines; the contract is one line."""
    return " ".join(message.split())


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Console-script entry point: one-line errors, the documented exit codes."""
    try:
        cli.main(args=list(argv) if argv is not None else None, prog_name=PROG, standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo(f"{PROG}: aborted", err=True)
        sys.exit(1)
    except click.UsageError as exc:
        click.echo(f"{PROG}: error: {_one_line(exc.format_message())}", err=True)
        sys.exit(2)
    except click.ClickException as exc:
        click.echo(f"{PROG}: error: {_one_line(exc.format_message())}", err=True)
        sys.exit(exc.exit_code)
    except RematError as exc:
        click.echo(f"{PROG}: error: {_one_line(str(exc))}", err=True)
        sys.exit(2)
    except Exception as exc:  # the last line of defence: one line, exit 1, traceback only on request
        if os.environ.get("REMAT_DEBUG"):
            raise
        click.echo(f"{PROG}: failed: {type(exc).__name__}: {_one_line(str(exc))} (REMAT_DEBUG=1 shows the traceback)",
                   err=True)
        sys.exit(1)
    sys.exit(0)
