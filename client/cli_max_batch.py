"""``remat-client max-batch``: the largest batch that trains within a memory limit, and at what time cost.

Two small profiles answer every batch size (remat.client.derived_trace, and remat.client.planning.graph_fit for
graph plans); the search plans each candidate batch (remat.client.planning.max_batch) and one measured training
step verifies the answer (the heavy side, through ``local_planner().max_batch``).
"""

from __future__ import annotations

from typing import Any

import click

from remat.client.cli_common import (
    emit_json,
    fail_input,
    format_bytes,
    format_kept,
    model_kwargs_option,
    model_options,
    model_request,
    run_with_progress,
)


def _overhead(text: str | None) -> float | None:
    if text is None:
        return None
    raw = text.strip().removesuffix("%")
    try:
        value = float(raw) / 100
    except ValueError:
        fail_input(f"--overhead: {text!r} is not a percentage (25%)")
    if not 0 <= value <= 10:
        fail_input(f"--overhead: {text!r} must be between 0% and 1000% of the step time")
    return value


def _batches(text: str) -> tuple[int, ...]:
    try:
        batches = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        fail_input(f"--profile-batches: {text!r} is not comma-separated batch sizes (2,4)")
    if len(batches) < 2 or batches[0] < 1:
        fail_input(f"--profile-batches: {text!r} must name two or more different batch sizes ≥ 1")
    return batches


@click.command("max-batch")
@click.argument("model")
@model_options
@model_kwargs_option
@click.option("--memory", "memory_text", default=None, metavar="SIZE|fit",
              help="Activation memory to fit: bytes or a size (8GiB, 512MB); 'fit' on CUDA is the device's free "
                   "memory less the model, its gradients and the batch (default: fit on cuda; required on cpu).")
@click.option("--overhead", "overhead_text", default=None, metavar="PCT",
              help="Largest recompute time allowed, as a share of the step (25%): the batch whose fastest plan "
                   "within it fits, instead of the least-memory plan's.")
@click.option("--profile-batches", "profile_batches", default="2,4", show_default=True, metavar="B1,B2",
              help="Batch sizes profiled (or found in the plan store) to derive every other one from.")
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
def max_batch_command(model: str, batch_size: int | None, input_shape: str | None, seq_len: int | None, device: str,
                      grads: str, dtype: str, model_kwargs: str | None, memory_text: str | None,
                      overhead_text: str | None, profile_batches: str, as_json: bool) -> None:
    """The largest batch of MODEL whose best checkpoint plan fits the memory, verified by a training step.

    MODEL is profiled at two small batch sizes; the trace at every other batch size is derived from them, the
    least-memory plan (linear's, nested's or, on the cpu, the graph plan acg's, whichever keeps least; with
    --overhead the least-memory chain plan within it) is planned at each candidate, and the largest batch that
    fits is run once with its plan to measure it. The next batch is shown not to fit, by prediction.

    \b
    Example:
      remat-client max-batch resnet152 --input-shape 3,128,128 --memory 2GiB --grads kept
      remat-client max-batch resnet152 --device cuda --input-shape 3,224,224 --memory fit --grads kept
    """
    from remat.client.budget_spec import BudgetError, parse_budget
    from remat.client.local_planner import local_planner
    from remat.client.planning.max_batch import MaxBatchError

    if batch_size is not None:
        fail_input("--batch-size: max-batch finds the batch size; --profile-batches sets the ones it profiles")
    if memory_text is None:
        if device != "cuda":
            fail_input("--memory: give the activation memory to fit on the cpu, e.g. --memory 4GiB")
        memory_text = "fit"
    try:
        memory = parse_budget(memory_text)
    except BudgetError as exc:
        fail_input(f"--memory: {str(exc).removeprefix('budget: ')}")
    overhead = _overhead(overhead_text)
    if overhead is not None and device == "cuda":
        # Measured on an H100: stage times profiled at batch 2 and 4 are kernel-launch bound, nearly constant
        # in the batch, so their lines put ResNet-152's recompute at 944% of the step at batch 2,481
        # (docs/benchmarks.md, "The largest batch that fits"). A choice by that share would be noise.
        fail_input("--overhead: on cuda the stage times of small-batch profiles do not extrapolate to the "
                   "largest batch (launch-bound); max-batch gives the least-memory plan, then `plan --budget` "
                   "picks the fastest that fits at that batch")
    batches = _batches(profile_batches)
    request = model_request(model, batches[0], input_shape, device, grads, dtype, model_kwargs, seq_len)
    try:
        report = run_with_progress(lambda progress: local_planner().max_batch(
            request, memory, overhead=overhead, profile_batches=batches, progress=progress), as_json)
    except (BudgetError, MaxBatchError) as exc:
        fail_input(f"--memory: {str(exc).removeprefix('memory: ').removeprefix('budget: ')}")
    if as_json:
        emit_json(report.to_dict())
    else:
        _print(report)


def _print(report: Any) -> None:
    plan, m = report.plan, report.measured
    within = f", recompute within {report.overhead:.0%} of the step" if report.overhead is not None else ""
    click.echo(f"{report.request.name}: largest batch {report.batch_size} (input {list(report.request.input_shape)}, "
               f"{report.request.device}, grads={report.request.grads}{within})")
    kept = (format_kept(plan) if plan.is_graph_plan
            else f"checkpoints {','.join(map(str, plan.checkpoints)) or '-'}")
    step = f"; step {m.step_ms:.0f} ms" if m.step_ms is not None else ""
    click.echo(f"  plan {plan.algorithm}, {kept}: predicted {format_bytes(plan.predicted_peak_bytes)}, "
               f"measured {format_bytes(m.measured_peak_bytes)} of {format_bytes(report.limit_bytes)}{step}")
    if plan.nested:
        click.echo("  run nested: each checkpointed segment re-runs its stages once more, one at a time, in its own "
                   "backward (apply does this; it keeps less than any one-level plan here)")
    if not report.recompute_extrapolates:
        click.echo(f"  recompute not estimated: stage times profiled at batch "
                   f"{', '.join(map(str, report.profiled_batches))} on cuda are launch-bound and do not extrapolate")
    elif plan.recompute_overhead is not None:  # a share: profiled stage times scale with the batch, not their noise
        click.echo(f"  recompute estimated at {plan.recompute_overhead:.0%} of the step")
    over = (report.next_plan.predicted_peak_bytes - report.next_limit_bytes if report.next_plan is not None
            else None)
    if over is not None and over > 0:
        click.echo(f"  batch {report.batch_size + 1} does not fit: its best plan ({report.next_plan.algorithm}) is "
                   f"predicted at {format_bytes(report.next_plan.predicted_peak_bytes)}, {over:,} bytes over "
                   f"{format_bytes(report.next_limit_bytes)}")
    elif report.out_of_memory_batch is not None:
        click.echo(f"  batch {report.out_of_memory_batch} was predicted to fit but its step ran out of device memory "
                   f"(the caching allocator's fragmentation is outside the prediction); batches between "
                   f"{report.batch_size + 1} and {report.out_of_memory_batch - 1} were not measured")
    if report.stepped_back:
        click.echo(f"  {report.stepped_back} step(s) back from a larger batch predicted to fit, whose step measured "
                   f"over the limit or ran out of device memory")
    if report.graph_plans_note is not None:
        click.echo(f"  graph plans (acg) not searched: {report.graph_plans_note}")
    click.echo(f"  derived from {report.fit_summary}")
