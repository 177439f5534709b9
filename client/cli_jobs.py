"""``remat-client submit`` and ``status``: jobs on a remat service's workers, submitted, followed and shown.

Every call goes through ``PlanServiceClient`` (httpx only, imported inside the commands); a service failure
exits 1 (the input was fine, the service was not), a malformed job id or a missing ``--server`` exits 2.
"""

from __future__ import annotations

import os
from typing import Any

import click

from remat.client.cli_common import (
    emit_json,
    fail_input,
    model_kwargs_option,
    model_options,
    model_request,
    print_model_table,
    run_with_progress,
    server_or_fail,
)
from remat.client.job_state import FINISHED_JOB_STATES, JOB_ID_PATTERN, JobState

__all__ = ["status_command", "submit_command"]


SUBMIT_TIMEOUT_S = 60.0
"""``submit``'s timeout when the timeout setting (``REMAT_TIMEOUT_S``, the config file's ``timeout_s``) is unset:
a service checks the model name against the zoo, which it loads once (seconds), so a first answer is longer."""


@click.command("submit")
@click.argument("model")
@model_options
@model_kwargs_option
@click.option("--queue", default=None, metavar="QUEUE",
              help="Workers' queue (default: the device, cpu or cuda; e.g. cuda-h100 for such workers).")
@click.option("--server", envvar="REMAT_SERVER", default=None, metavar="URL",
              help="The remat service (env REMAT_SERVER). The write token comes from REMAT_API_TOKEN.")
@click.option("--wait", is_flag=True, help="Wait for the job and show its plans (as `status --wait`).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output: the job.")
def submit_command(model: str, batch_size: int | None, input_shape: str | None, seq_len: int | None, device: str,
                   grads: str, dtype: str, model_kwargs: str | None, queue: str | None, server: str | None,
                   wait: bool, as_json: bool) -> None:
    """Have the service's workers profile MODEL, plan it with every algorithm and validate each plan.

    Prints the job id; follow it with `remat-client status JOB`. The plans land in the service's plan
    database, where `remat-client plan MODEL --server URL` and `fetch_and_apply` find them.

    \b
    Example:
      remat-client submit resnet50 --device cuda --server http://plans:8000 --wait
    """
    from remat.client.errors import ServiceError
    from remat.client.service_client import PlanServiceClient, default_timeout

    request = model_request(model, batch_size, input_shape, device, grads, dtype, model_kwargs, seq_len)
    if request.source == "hf":
        from remat.client.hf_models import is_hf_path

        if is_hf_path(request.name.removeprefix("hf:")):
            fail_input(f"{request.name}: a service's workers never read a file of yours; submit hf:NAME with "
                       f"--model-kwargs, or plan this one here (`remat-client plan {model}`)")
    elif request.source != "torchvision" or request.model_kwargs:
        # A worker that imported and called what a request names would run code chosen by whoever submits.
        fail_input(f"{request.name}: a service's workers build torchvision models with their default arguments "
                   f"only; plan this one here (`remat-client plan {model}`), or upload its trace with "
                   f"`plan {model} --server URL` and REMAT_API_TOKEN set")
    with PlanServiceClient(server_or_fail(server), token=os.environ.get("REMAT_API_TOKEN") or None,
                           timeout=default_timeout(SUBMIT_TIMEOUT_S)) as client:
        try:
            job = client.submit_job(request, queue=queue)
        except ServiceError as exc:
            raise click.ClickException(str(exc)) from None
        if wait:
            _follow_job(client, job["id"], as_json=as_json, timeout_s=None)
            return
    if as_json:
        emit_json(job)
    else:
        click.echo(job["id"])
        note = job.get("message") if job.get("leader_id") or job["state"] == JobState.PENDING else None
        if note:
            click.echo(f"({note})", err=True)


@click.command("status")
@click.argument("job_id", metavar="JOB")
@click.option("--server", envvar="REMAT_SERVER", default=None, metavar="URL", help="The remat service.")
@click.option("--wait", is_flag=True, help="Wait until the job ends, with a progress bar; exit 1 if it failed.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0), default=None,
              help="With --wait: give up after this many seconds (exit 1; the job goes on).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output: the job.")
def status_command(job_id: str, server: str | None, wait: bool, timeout_s: float | None, as_json: bool) -> None:
    """Show a job's state and progress and, once it has succeeded, its plans (or why it failed).

    \b
    Example:
      remat-client status 3f2b9c1e-0d4a-4b7e-9a55-2f0c1d7e8a90 --server http://plans:8000 --wait
    """
    import re

    from remat.client.errors import ServiceError

    if not re.fullmatch(JOB_ID_PATTERN, job_id):
        fail_input(f"JOB: {job_id!r} is not a job id (the UUID `remat-client submit` printed)")
    from remat.client.service_client import PlanServiceClient

    with PlanServiceClient(server_or_fail(server), token=os.environ.get("REMAT_API_TOKEN") or None) as client:
        try:
            if wait:
                _follow_job(client, job_id, as_json=as_json, timeout_s=timeout_s)
                return
            job = client.get_job(job_id)
        except ServiceError as exc:
            raise click.ClickException(str(exc)) from None
    _show_job(job, as_json=as_json)


POLL_INTERVAL_S = 1.0


def _follow_job(client: Any, job_id: str, *, as_json: bool, timeout_s: float | None) -> None:
    """Poll a job until it ends, drawing its progress on stderr (when stderr is a terminal)."""
    import time

    from remat.client.errors import ServiceError

    deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def poll(progress: Any) -> dict[str, Any]:
        while True:
            try:
                job = client.get_job(job_id)
            except ServiceError as exc:
                raise click.ClickException(str(exc)) from None
            if progress is not None:
                progress(job.get("message") or job["state"], float(job.get("progress") or 0.0))
            if job["state"] in FINISHED_JOB_STATES:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise click.ClickException(f"job {job_id} is still {job['state']} after {timeout_s:g} s "
                                           f"({job.get('message') or 'no message'}); it goes on")
            time.sleep(POLL_INTERVAL_S)

    _show_job(run_with_progress(poll, as_json), as_json=as_json)


def _show_job(job: dict[str, Any], *, as_json: bool) -> None:
    """A job's state line, then its plans when it succeeded; exit 1 when it failed."""
    from remat.client.report import ModelReport

    state = job["state"]
    if as_json:
        emit_json(job)
    elif state == JobState.SUCCEEDED and job.get("kind", "profile") == "profile" and job.get("result"):
        report = ModelReport.from_job(job)
        print_model_table(report, f"job {job['id']}" + (", plans already stored" if report.from_store else ""))
    else:
        line = f"{job['id']}: {state}"
        if state not in FINISHED_JOB_STATES:
            line += f", {float(job.get('progress') or 0):.0%}"
        if job.get("message"):
            line += f" ({job['message']})"
        click.echo(line)
    if state == JobState.FAILED:
        raise click.ClickException(f"job {job['id']} failed: {job.get('error') or 'no reason recorded'}")
