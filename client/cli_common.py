"""What every ``remat-client`` command shares: the one-line input error (exit 2), JSON output, byte
formatting, the zoo-model options and the request they make, and the progress bar on stderr.

Kept apart from ``cli.py`` so that command groups in their own modules (``zoo_command.py``) use the same
conventions without importing the whole CLI.
"""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import click

from remat.client.devices import DEVICES
from remat.client.errors import RematError
from remat.client.precision import PRECISIONS
from remat.client.request import DEFAULT_CPU_BATCH, DEFAULT_CPU_RESOLUTION, DEFAULT_CUDA_BATCH

__all__ = ["InputError", "emit_json", "fail_input", "format_bytes", "model_kwargs_option", "model_options",
           "parse_shape", "request",
           "run_with_progress", "server_or_fail"]


class InputError(click.ClickException):
    """Bad user input: reported on one line with exit code 2."""

    exit_code = 2


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
                        help="Keyword arguments for MODEL's builder, a JSON object: '{\"num_classes\": 10}'.")(fn)


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


def request(model: str, batch_size: int | None, input_shape: str | None, device: str, grads: str,
            dtype: str = "float32", model_kwargs: str | None = None) -> Any:
    """The ``ModelRequest`` of a command's MODEL and options; a bad one exits 2 with one line."""
    from remat.client.model_spec import parse_model_kwargs
    from remat.client.request import default_request

    sample_shape = parse_shape(input_shape)
    try:
        return default_request(model, batch_size=batch_size, sample_shape=sample_shape, device=device, grads=grads,
                               dtype=dtype, model_kwargs=parse_model_kwargs(model_kwargs))
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
