"""``remat-client plan``, ``trace``, ``measure`` and ``evaluate``: plans for a MODEL or a trace file, and the
measurements behind them.

Planning from a trace file never imports torch, so ``remat-client plan --trace`` starts in a fraction of a
second; the MODEL commands reach torch only through ``remat.client.local_planner.local_planner()``, imported
inside the command. ``plan MODEL --server`` asks a remat service instead (httpx only); its failures exit 1,
bad input exits 2.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from remat.client.cli_common import (
    OutputFile,
    emit_json,
    fail_input,
    format_algorithm,
    format_bytes,
    format_checkpoints,
    format_kept,
    model_kwargs_option,
    model_options,
    model_request,
    print_model_table,
    run_with_progress,
)
from remat.client.derived_trace import describe_derivation
from remat.client.errors import RematError
from remat.client.measurement import Measurement
from remat.client.plan import COST_MODELS, Plan
from remat.client.trace import Trace, load_trace

__all__ = ["evaluate_command", "measure_command", "plan_command", "trace_command"]


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
        table.add_row(format_algorithm(p), format_kept(p), p.cost_model,
                      format_bytes(p.predicted_peak_bytes), f"{p.saving:.1%}", recompute)
    # A pipe gets no terminal width; 80 columns would truncate the checkpoint lists.
    Console(width=None if sys.stdout.isatty() else 140).print(table)


def _load_trace_or_fail(path: str) -> Trace:
    try:
        return load_trace(path)
    except RematError as exc:
        fail_input(f"{path}: {exc}")


def _algorithms(name: str) -> list[str]:
    from remat.client.planning.planners import PLANNERS

    if name == "all":
        return list(PLANNERS)
    if name not in PLANNERS:
        fail_input(f"--algorithm: {name!r} is unknown; choose one of {', '.join(PLANNERS)} or all")
    return [name]


@click.command("plan")
@click.argument("model", required=False)
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), help="Plan from a remat-trace/1 file.")
@click.option("--algorithm", default="all", show_default=True, help="Planner name, or all.")
@click.option("--cost-model", type=click.Choice(COST_MODELS), default=None,
              help="Report every plan under this model (default: each planner's own).")
@model_options
@model_kwargs_option
@click.option("--budget", "budget_text", default=None, metavar="SIZE",
              help="The fastest plan whose activation peak fits: bytes, 6GiB, 6GB, 512MiB, 70% (of the "
                   "no-checkpoint peak) or fit (CUDA: the device's free room).")
@click.option("--refresh", is_flag=True, help="Profile and measure again even if the store has the answer.")
@click.option("--server", envvar="REMAT_SERVER", default=None, metavar="URL",
              help="Fetch MODEL's plans from this remat service (env REMAT_SERVER) instead of the local store.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def plan_command(model: str | None, trace_path: str | None, algorithm: str, cost_model: str | None,
                 batch_size: int | None, input_shape: str | None, seq_len: int | None, device: str, grads: str,
                 dtype: str, model_kwargs: str | None, budget_text: str | None, refresh: bool, server: str | None,
                 as_json: bool) -> None:
    """Plan checkpoints for MODEL (a zoo name such as resnet152, or hf:gpt2) or for a trace file.

    For MODEL: profile on this machine, plan with every algorithm, measure each plan with a real training
    step and keep the answer in the local plan store; the same request later answers from the store.
    With --server, the plans come from the service; if it has none and REMAT_API_TOKEN is set, the model
    is profiled here and its trace uploaded for the service to plan.

    \b
    Example:
      remat-client plan resnet152
      remat-client plan resnet152 --budget 70%
      remat-client plan mypkg.nets:build_unet --input-shape 3,256,256 --model-kwargs '{"depth": 5}'
      remat-client plan hf:gpt2 --seq-len 256 --model-kwargs '{"n_layer": 6}'
      remat-client plan resnet50 --server http://plans:8000 --json
      remat-client plan --trace examples/toy-trace.json
    """
    if model is not None and trace_path is not None:
        fail_input("give either MODEL or --trace FILE, not both")
    budget = _budget_or_fail(budget_text) if budget_text is not None else None
    if budget is not None and (algorithm != "all" or cost_model is not None):
        fail_input("--budget picks its own plan under the pytorch model: drop --algorithm and --cost-model")
    if trace_path is None:
        if model is None:
            fail_input("give a zoo MODEL or --trace FILE")
        if algorithm != "all" or cost_model is not None:
            fail_input("--algorithm and --cost-model apply to --trace; MODEL is planned with every algorithm "
                       "under the pytorch model")
        request = model_request(model, batch_size, input_shape, device, grads, dtype, model_kwargs, seq_len)
        if budget is not None:
            _plan_model_for_budget(request, budget, refresh=refresh, as_json=as_json, server=server)
        elif server:
            _plan_model_from_server(request, server, refresh=refresh, as_json=as_json)
        else:
            _plan_model(request, refresh=refresh, as_json=as_json)
        return
    if server:
        fail_input("--server applies to MODEL; plans from a --trace file are computed here")
    trace = _load_trace_or_fail(trace_path)
    if budget is not None:
        _plan_trace_for_budget(trace, budget, label=trace.metadata.get("model") or Path(trace_path).name,
                               as_json=as_json)
        return
    names = _algorithms(algorithm)
    from remat.client.planning.plans import plan_all

    plans = plan_all(trace, cost_model=cost_model, algorithms=names)
    if as_json:
        emit_json(plans[0].to_dict() if algorithm != "all" else {"plans": [p.to_dict() for p in plans]})
    else:
        label = trace.metadata.get("model") or Path(trace_path).name
        _print_plan_table(plans, f"{label}: {trace.num_stages} stages")


def _budget_or_fail(text: str) -> Any:
    from remat.client.budget_spec import BudgetError, parse_budget

    try:
        return parse_budget(text)
    except BudgetError as exc:
        fail_input(f"--{exc}")


def _plan_trace_for_budget(trace: Trace, budget: Any, *, label: str, as_json: bool) -> None:
    """``plan --trace FILE --budget X``: the budget plan beside none and linear, all predicted."""
    from remat.client.budget_spec import BudgetError
    from remat.client.planning.plans import make_budget_plan, plan_all

    plans = plan_all(trace, cost_model="pytorch", algorithms=["none", "linear"])
    try:
        budget_bytes = budget.resolve(baseline_peak_bytes=plans[0].predicted_peak_bytes)
        chosen = make_budget_plan(trace, budget_bytes)
    except BudgetError as exc:  # malformed, unresolvable here, or infeasible
        fail_input(f"--{exc}")
    if as_json:
        emit_json(chosen.to_dict())
    else:
        _print_plan_table([*plans, chosen], f"{label}: {trace.num_stages} stages, budget {budget.text} = "
                                            f"{format_bytes(budget_bytes)}")


def _plan_model_for_budget(request: Any, budget: Any, *, refresh: bool, as_json: bool, server: str | None) -> None:
    """``plan MODEL --budget X``: embedded, or with ``--server`` picked by the service from its frontier."""
    from remat.client.budget_spec import BudgetError
    from remat.client.local_planner import local_planner

    try:
        budget.check_device(request.device)  # before the service is asked or the model profiled, on both paths
        if server:
            report = _budget_report_from_server(request, budget, server, refresh=refresh, as_json=as_json)
        else:
            report = run_with_progress(lambda progress: local_planner().budget_report(request, budget, progress,
                                                                               refresh=refresh), as_json)
    except BudgetError as exc:  # malformed, unresolvable here, or infeasible
        fail_input(f"--{exc}")
    if as_json:
        emit_json(report.to_dict())
    else:
        print_model_table(report, source=f"budget {budget.text}")


def _plan_model(request: Any, *, refresh: bool, as_json: bool) -> None:
    from remat.client.local_planner import local_planner

    report = None if refresh else local_planner().cached_report(request)
    if report is None:
        planner = local_planner()
        report = run_with_progress(lambda progress: planner.profile_and_plan(request, progress, refresh=refresh),
                                   as_json)
    if as_json:
        emit_json(report.to_dict())
    else:
        print_model_table(report)


def _budget_report_from_server(request: Any, budget: Any, server: str, *, refresh: bool, as_json: bool) -> Any:
    """The service's answer for a budget; service failures exit 1 as in ``_plan_model_from_server``."""
    from remat.client.budget_spec import BudgetError
    from remat.client.errors import PlanError, ServiceError
    from remat.client.fetch import budget_report_from_service
    from remat.client.service_client import PlanServiceClient

    if refresh:
        fail_input("--refresh with --budget --server: refresh the model's plans first (plan MODEL --refresh)")
    token = os.environ.get("REMAT_API_TOKEN") or None
    with PlanServiceClient(server, token=token) as client:
        try:
            client.health()
            return run_with_progress(lambda progress: budget_report_from_service(
                request, client, budget, upload=token is not None, progress=progress), as_json)
        except BudgetError:
            raise  # input (exit 2), handled by the caller
        except (ServiceError, PlanError) as exc:
            raise click.ClickException(str(exc)) from None


def _plan_model_from_server(request: Any, server: str, *, refresh: bool, as_json: bool) -> None:
    """``plan MODEL --server URL``: the service's plans for the request's key, uploading a trace if needed.

    Service failures exit 1 (not 2): the input was fine, the service was not. A malformed URL is input (2).
    """
    from remat.client.errors import PlanError, ServiceError
    from remat.client.fetch import report_from_service
    from remat.client.service_client import PlanServiceClient

    # The write token comes from the environment only: a --token flag would leak it into shell history and ps.
    token = os.environ.get("REMAT_API_TOKEN") or None
    if refresh and token is None:
        fail_input("--refresh with --server profiles here and uploads the trace: set REMAT_API_TOKEN")
    with PlanServiceClient(server, token=token) as client:
        try:
            client.health()  # an unreachable server fails now, not after building the model
            report = run_with_progress(lambda progress: report_from_service(
                request, client, upload=token is not None, refresh=refresh, progress=progress), as_json)
        except (ServiceError, PlanError) as exc:
            raise click.ClickException(str(exc)) from None
    if as_json:
        emit_json({**report.to_dict(), "server": client.base_url})
    elif report.from_store and report.derived_from:
        print_model_table(report, f"from the service at {client.base_url}, derived from its "
                                  f"{describe_derivation(report.derived_along, report.derived_from)}")
    elif report.from_store:
        print_model_table(report, f"from the service at {client.base_url}")
    else:
        print_model_table(report, f"profiled here, planned by the service at {client.base_url}")


@click.command("trace")
@click.argument("model")
@model_options
@model_kwargs_option
@click.option("--out", type=OutputFile(stdout=True), default="-", show_default=True,
              help="Where to write the remat-trace/1 JSON ('-' for stdout).")
@click.option("--json", "as_json", is_flag=True,
              help="With --out FILE: print {out, model, num_stages, model_hash} instead of a line on stderr.")
def trace_command(model: str, batch_size: int | None, input_shape: str | None, seq_len: int | None, device: str,
                  grads: str, dtype: str, model_kwargs: str | None, out: str, as_json: bool) -> None:
    """Profile MODEL on this machine and write its layer memory trace.

    \b
    Example:
      remat-client trace resnet18 --batch-size 2 --input-shape 3,64,64 --out resnet18.json
    """
    from remat.client.local_planner import local_planner

    request = model_request(model, batch_size, input_shape, device, grads, dtype, model_kwargs, seq_len)
    trace = run_with_progress(lambda progress: local_planner().profile_trace(request, progress), out == "-" or as_json)
    text = json.dumps(trace.to_dict(), indent=1)
    if out == "-":
        click.echo(text)  # the trace is JSON already: --json changes nothing here
        return
    Path(out).write_text(text + "\n")
    if as_json:
        emit_json({"out": out, "model": request.name, "num_stages": trace.num_stages,
                   "model_hash": trace.metadata.get("model_hash")})
    else:
        click.echo(f"{out}: {trace.num_stages} stages of {request.name}", err=True)


@click.command("measure")
@click.argument("model")
@click.option("--algorithm", default="linear", show_default=True, help="Planner whose plan is measured.")
@model_options
@model_kwargs_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def measure_command(model: str, algorithm: str, batch_size: int | None, input_shape: str | None,
                    seq_len: int | None, device: str, grads: str, dtype: str, model_kwargs: str | None,
                    as_json: bool) -> None:
    """Measure one algorithm's plan for MODEL with a real training step, beside no checkpointing.

    \b
    Example:
      remat-client measure resnet18 --algorithm linear --grads kept --json
    """
    from remat.client.local_planner import local_planner

    names = _algorithms(algorithm)
    if len(names) != 1:
        fail_input("--algorithm: measure takes one planner name, not all")
    request = model_request(model, batch_size, input_shape, device, grads, dtype, model_kwargs, seq_len)
    result = run_with_progress(lambda progress: local_planner().measure_algorithm(request, names[0], progress),
                               as_json).to_dict()
    if as_json:
        emit_json(result)
        return
    for name in ("algorithm", "grads", "predicted_peak_bytes", "measured_peak_bytes", "baseline_measured_peak_bytes",
                 "step_ms", "step_spread_ms", "baseline_step_ms", "baseline_step_spread_ms"):
        value = result.get(name)
        shown = format_bytes(value) if name.endswith("_bytes") else (f"{value:.1f}" if isinstance(value, float)
                                                                      else value)
        click.echo(f"{name:>30}: {shown}")
    if result.get("step_ms") is not None and Measurement.from_dict(result).within_noise:
        click.echo(f"{'overhead':>30}: within noise (no larger than the rounds' spread)")


MAX_CHECKPOINTS_FILE_BYTES = 16 * 2**20
"""The largest ``--checkpoints-file`` ``evaluate`` reads: a plan per line, so 16 MiB holds some 10^5 plans of a
deep model (and more than anyone evaluates in one go); a larger file is a mistake, refused before it is read."""


def _read_checkpoint_sets(path: str, num_stages: int) -> list[tuple[int, ...]]:
    """One plan per line, comma-separated boundaries; an empty line is the empty plan."""
    from remat.client.plan import validate_checkpoints
    from remat.client.user_files import FileTooLargeError, read_limited

    try:
        text = read_limited(path, MAX_CHECKPOINTS_FILE_BYTES, "a checkpoints file").decode("utf-8")
    except FileTooLargeError as exc:
        fail_input(f"--checkpoints-file {path!r}: {exc}")
    except (OSError, UnicodeDecodeError) as exc:
        fail_input(f"--checkpoints-file {path!r}: cannot be read ({exc})")
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
            fail_input(f"{path}:{lineno}: {detail}")
    return sets


@click.command("evaluate")
@click.option("--trace", "trace_path", required=True, type=click.Path(dir_okay=False))
@click.option("--cost-model", type=click.Choice(COST_MODELS), required=True)
@click.option("--checkpoints-file", required=True, type=click.Path(dir_okay=False),
              help="One plan per line: comma-separated boundaries; an empty line for no checkpoints.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def evaluate_command(trace_path: str, cost_model: str, checkpoints_file: str, as_json: bool) -> None:
    """Predicted peak of given checkpoint sets under a cost model.

    \b
    Example:
      printf "3,6\n\n" > sets.txt
      remat-client evaluate --trace examples/toy-trace.json --cost-model pytorch --checkpoints-file sets.txt
    """
    trace = _load_trace_or_fail(trace_path)
    sets = _read_checkpoint_sets(checkpoints_file, trace.num_stages)
    from remat.client.planning.cost_models import peak

    peaks = [peak(trace, s, cost_model) for s in sets]
    if as_json:
        emit_json({"cost_model": cost_model, "peaks": peaks})
    else:
        for s, p in zip(sets, peaks, strict=True):
            click.echo(f"{format_bytes(p):>12}  {format_checkpoints(s, limit=1000)}")
