"""``remat-client zoo torchvision|hf [--filter GLOB]``: plan a whole model zoo, here or on the service's workers.

Without a server the models run in this process one after another, each stored in the local plan store as it
finishes (the embedded default); with ``--server`` (or ``REMAT_SERVER``) one ``POST /v1/zoo`` makes a job per
model and this command follows the batch. Either way it ends with the same table of ``ZooRow``s
(remat.client.zoo_batch): stages, peak without checkpointing and with ``linear``, saving, step-time overhead,
prediction error, and every failure with its reason. Exit 0 when every model planned, 1 when some failed,
2 for bad input, 130 when interrupted (finished results stay stored; the same command resumes).
"""

from __future__ import annotations

import csv
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import click

from remat.client.cli_common import (
    OutputFile,
    emit_json,
    fail_input,
    format_bytes,
    model_options,
    parse_shape,
    server_or_fail,
)
from remat.client.errors import RematError
from remat.client.job_state import JobState
from remat.client.zoo_batch import ZOOS, ZooRow

__all__ = ["zoo_command"]

POLL_INTERVAL_S = 1.0
INTERRUPTED_EXIT = 130


def _pct(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:+.{digits}%}"


def _overhead(row: ZooRow) -> str:
    return "within noise" if row.overhead_within_noise else _pct(row.overhead, 0)


def _line(row: ZooRow) -> str:
    """The one line printed when a model finishes."""
    name = row.model.removeprefix("torchvision:")
    if row.status == "failed":
        return f"✗ {name}: failed — {row.reason}"
    source = " (stored)" if row.status == "stored" else ""
    saving = "-" if row.saving is None else f"{row.saving:.1%}"
    below = ""
    if _below_linear(row):
        least = "-" if row.least_saving is None else f"{row.least_saving:.1%}"
        below = f", least with {row.least_algorithm}: {format_bytes(row.least_peak_bytes)} ({least} saved)"
    return (f"✓ {name}{source}: {row.num_stages} stages, {format_bytes(row.none_peak_bytes)} → "
            f"{format_bytes(row.linear_peak_bytes)} ({saving} saved, step {_overhead(row)}){below}")


def _below_linear(row: ZooRow) -> bool:
    """Whether a plan other than ``linear`` measured a lower peak than it."""
    return (row.least_peak_bytes is not None and row.linear_peak_bytes is not None
            and row.least_peak_bytes < row.linear_peak_bytes)


def _least(row: ZooRow) -> str:
    """The least measured peak, whose plan it is and what it saves: ``acg 14.8 MiB (81.9%)``."""
    if row.least_peak_bytes is None:
        return "-"
    saving = "" if row.least_saving is None else f" ({row.least_saving:.1%})"
    return f"{row.least_algorithm} {format_bytes(row.least_peak_bytes)}{saving}"


def _print_table(rows: Sequence[ZooRow], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in ("model", "stages", "none peak", "linear peak", "saving", "step overhead", "prediction error",
                   "least peak", "status"):
        table.add_column(column, justify="left" if column in ("model", "status") else "right")
    for r in rows:
        status = r.status if r.status != "failed" else f"failed: {r.reason}"
        table.add_row(r.model.removeprefix("torchvision:"), "-" if r.num_stages is None else str(r.num_stages),
                      format_bytes(r.none_peak_bytes), format_bytes(r.linear_peak_bytes),
                      "-" if r.saving is None else f"{r.saving:.1%}", _overhead(r),
                      _pct(r.prediction_error, 2), _least(r), status)
    Console(width=None if sys.stdout.isatty() else 220).print(table)
    click.echo("Peaks are activation memory of one training step, measured; saving and overhead are the linear "
               "plan's against no checkpointing (within noise: no larger than the steps' timing spreads); least "
               "peak: the plan of every planner that measured the least, with its saving (linear's on a tie).")


def _write_csv(path: str, rows: Sequence[ZooRow]) -> None:
    fields = list(ZooRow.__dataclass_fields__)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            entry = r.to_dict()
            entry["input_shape"] = "x".join(str(d) for d in r.input_shape) if r.input_shape else ""
            writer.writerow(entry)


class _Bar:
    """One overall progress bar on stderr (only when stderr is a terminal and the output is not JSON), with a
    line printed above it per finished model."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self._progress: Any = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self._task = self._progress.add_task("starting", total=total)

    def __enter__(self) -> _Bar:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def update(self, description: str, completed: float) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=description[:40], completed=completed)

    def say(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text, highlight=False, markup=False)
        else:
            click.echo(text, err=True)


def _finish(rows: list[ZooRow], *, title: str, as_json: bool, csv_path: str | None, total: int,
            extra: dict[str, Any] | None = None) -> None:
    if csv_path:
        _write_csv(csv_path, rows)
    if as_json:
        emit_json({**(extra or {}), "total": total, "rows": [r.to_dict() for r in rows]})
    else:
        _print_table(rows, title)
    failed = [r for r in rows if r.status == "failed"]
    if failed:
        raise click.ClickException(f"{len(failed)} of {total} models failed: "
                                   + "; ".join(r.model.removeprefix("torchvision:") for r in failed))


def _run_embedded(requests: list[Any], *, refresh: bool, as_json: bool, csv_path: str | None, title: str) -> None:
    from remat.client.local_planner import local_planner

    rows: list[ZooRow] = []
    show = not as_json and sys.stderr.isatty()
    with _Bar(len(requests), show) as bar:
        def on_start(req: Any) -> None:
            bar.update(f"{req.name.removeprefix('torchvision:')}", len(rows))

        def on_row(row: ZooRow) -> None:
            rows.append(row)
            bar.say(_line(row))
            bar.update("", len(rows))

        def progress(message: str, fraction: float) -> None:
            name = requests[len(rows)].name.removeprefix("torchvision:")
            bar.update(f"{name}: {message}", len(rows) + fraction)

        try:
            local_planner().plan_zoo(requests, refresh=refresh, on_start=on_start, on_row=on_row,
                         progress=progress if show else None)
        except KeyboardInterrupt:
            bar.__exit__()
            if rows and not as_json:
                _print_table(rows, title + " (interrupted)")
            click.echo(f"interrupted after {len(rows)} of {len(requests)} models; their results are stored — run "
                       f"the same command again to go on (stored models are skipped)", err=True)
            sys.exit(INTERRUPTED_EXIT)
    _finish(rows, title=title, as_json=as_json, csv_path=csv_path, total=len(requests))


def _server_and_token(server: str | None) -> tuple[str, str]:
    """The service's URL and write token for ``zoo --server``, or exit 2 naming what is missing or malformed."""
    from remat.client.service_client import checked_server_url

    server = checked_server_url(server_or_fail(server))
    token = os.environ.get("REMAT_API_TOKEN") or None
    if token is None:
        fail_input("zoo --server submits jobs: set REMAT_API_TOKEN to the service's write token")
    return server, token


def _run_on_server(body: dict[str, Any], server: str, token: str, *, as_json: bool, csv_path: str | None,
                   title: str, sleep: Callable[[float], None] = time.sleep) -> None:
    from remat.client.errors import ServiceError
    from remat.client.service_client import PlanServiceClient

    with PlanServiceClient(server, token=token) as client:
        try:
            client.health()
            batch = client.submit_zoo(body)
        except ServiceError as exc:
            raise click.ClickException(str(exc)) from None
        total = batch["total"]
        click.echo(f"zoo batch {batch['id']}: {total} models on the service at {client.base_url}", err=True)
        reported: set[str] = set()
        show = not as_json and sys.stderr.isatty()
        with _Bar(total, show) as bar:
            try:
                while True:
                    for entry in batch["models"]:
                        if entry["row"] is not None and entry["job_id"] not in reported:
                            reported.add(entry["job_id"])
                            bar.say(_line(ZooRow.from_dict(entry["row"])))
                    running = [e["model"].removeprefix("torchvision:") for e in batch["models"]
                               if e["state"] == JobState.RUNNING]
                    bar.update(", ".join(running) or "queued", batch["progress"] * total)
                    if batch["done"]:
                        break
                    sleep(POLL_INTERVAL_S)
                    try:
                        batch = client.get_zoo(batch["id"])
                    except ServiceError as exc:
                        raise click.ClickException(f"{exc} (the batch {batch['id']} goes on)") from None
            except KeyboardInterrupt:
                bar.__exit__()
                click.echo(f"stopped following; the batch's jobs go on on the service: GET {client.base_url}/v1/zoo/"
                           f"{batch['id']}, or run the same command again (models already stored finish at once)",
                           err=True)
                sys.exit(INTERRUPTED_EXIT)
    rows = [ZooRow.from_dict(e["row"]) for e in batch["models"] if e["row"] is not None]
    _finish(rows, title=title + f", batch {batch['id']}", as_json=as_json, csv_path=csv_path, total=total,
            extra={"batch_id": batch["id"], "server": server})


@click.command("zoo")
@click.argument("zoo", type=click.Choice(ZOOS))
@click.option("--filter", "pattern", default=None, metavar="GLOB",
              help="Models whose name matches, e.g. 'resnet*' (several: 'resnet*,vgg1?'). Default: all.")
@model_options
@click.option("--refresh", is_flag=True, help="Profile again models whose plans are stored.")
@click.option("--server", envvar="REMAT_SERVER", default=None, metavar="URL",
              help="Run on a remat service's workers (needs REMAT_API_TOKEN); default: here, one after another.")
@click.option("--queue", default=None, metavar="QUEUE", help="With --server: the workers' queue (default: --device).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output: every model's row.")
@click.option("--csv", "csv_path", type=OutputFile(), default=None,
              help="Also write the rows to this CSV file.")
def zoo_command(zoo: str, pattern: str | None, batch_size: int | None, input_shape: str | None,
                seq_len: int | None, device: str, grads: str, dtype: str, refresh: bool, server: str | None,
                queue: str | None, as_json: bool, csv_path: str | None) -> None:
    """Plan every classification model of ZOO (or those --filter selects) and tabulate what checkpointing saves.

    ZOO is torchvision (its classification models) or hf (small Hugging Face architectures: GPT-2, a Llama-style
    decoder, Mixtral, BERT, T5, ViT, CLIP); there --seq-len applies to the token models and CLIP. A model built
    for one image size (torchvision's ViT and MaxViT, hf's ViT) is planned at it, whatever --input-shape says.

    \b
    Examples:
      remat-client zoo torchvision --filter 'resnet*' --batch-size 2
      remat-client zoo hf --filter 'gpt2,llama' --seq-len 64
      remat-client zoo torchvision --device cuda --batch-size 32 --server http://plans:8000 --csv zoo.csv
    """
    from remat.client.zoo_batch import select_zoo_models, zoo_requests

    token = None
    if server is not None or queue is not None:  # a job that cannot be sent is refused before the zoo's names
        server, token = _server_and_token(server)  # are read: that imports torchvision (seconds)
    models = select_zoo_models(zoo, pattern)
    shape = parse_shape(input_shape)
    title = (f"{zoo}{f' {pattern}' if pattern else ''}: {len(models)} models, {device}, grads={grads}, {dtype}"
             f"{f', batch {batch_size}' if batch_size else ''}{f', {seq_len} tokens' if seq_len else ''}")
    if server is not None and token is not None:  # the service builds and checks the requests
        body = {"zoo": zoo, "filter": pattern, "batch_size": batch_size, "input_shape": list(shape) if shape else None,
                "device": device, "grads": grads, "dtype": dtype, "queue": queue, "refresh": refresh}
        if seq_len is not None:
            body["seq_len"] = seq_len  # only when given: a service without hf models knows no such field
        _run_on_server(body, server, token, as_json=as_json, csv_path=csv_path, title=title)
        return
    try:
        requests = zoo_requests(models, batch_size=batch_size, sample_shape=shape, seq_len=seq_len, device=device,
                                grads=grads, dtype=dtype)
    except RematError as exc:
        fail_input(str(exc))
    _run_embedded(requests, refresh=refresh, as_json=as_json, csv_path=csv_path, title=title)
