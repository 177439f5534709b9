"""``remat-worker``: start a profiling worker on the queues of this node's device.

    remat-worker                         # queue cpu (REMAT_WORKER_QUEUES), one job at a time
    remat-worker --queues cuda           # a GPU node; one process, replaced after every job
    remat-worker --queues cpu,plan -c 2  # also the planning jobs uploads defer (cubic on large traces)

The database, the broker and every limit come from the same ``REMAT_*`` settings as the service. Equivalent
to ``celery -A remat.worker.celery_app worker -Q cpu -c 1``, with the options checked first.
"""

from __future__ import annotations

import re
import sys

import click
from pydantic import ValidationError

from remat.client.devices import DEVICES
from remat.service.celery_client import PLAN_QUEUE
from remat.service.config import ServiceSettings
from remat.service.keys import QUEUE_PATTERN

_QUEUE_RE = re.compile(f"^({QUEUE_PATTERN}|{PLAN_QUEUE})$")
_DEVICE_QUEUES = ", ".join(DEVICES)


def _settings(**overrides: object) -> ServiceSettings:
    try:
        return ServiceSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(p) for p in error["loc"]) or "settings"
        raise click.UsageError(f"{field}: {error['msg']} (from the option or REMAT_{field.upper()})") from None


@click.command("remat-worker", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--queues", "-Q", metavar="Q[,Q...]",
              help=f"Queues to consume: {_DEVICE_QUEUES}, cuda-<gpu model>, plan. Default: REMAT_WORKER_QUEUES or cpu.")
@click.option("--concurrency", "-c", type=int, help="Jobs run at once. Default: REMAT_WORKER_CONCURRENCY or 1; "
              "keep 1 per GPU (CUDA_VISIBLE_DEVICES per worker).")
@click.option("--hostname", "-n", default=None, help="Worker name (default: remat@<host>); unique per node.")
@click.option("--loglevel", "-l", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False))
def worker(queues: str | None, concurrency: int | None, hostname: str | None, loglevel: str) -> None:
    """Run a remat profiling worker until interrupted (Ctrl-C finishes the running job's message first)."""
    settings = _settings(worker_queues=queues, worker_concurrency=concurrency)
    names = settings.queues
    bad = [q for q in names if not _QUEUE_RE.match(q)]
    if not names or bad:
        raise click.UsageError(f"--queues: {', '.join(bad) or 'none given'}: each must be "
                               f"{_DEVICE_QUEUES}, cuda-<gpu model> or plan")
    from remat.worker.celery_app import make_app

    app = make_app(settings)
    argv = ["worker", "-Q", ",".join(settings.queue_name(q) for q in names),
            "-c", str(settings.worker_concurrency), "--loglevel", loglevel.upper(), "--without-gossip",
            "--without-mingle"]
    if hostname:
        argv += ["-n", hostname]
    app.worker_main(argv=argv)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: a bad option or setting is one line on stderr and exit code 2."""
    try:
        worker.main(args=argv, prog_name="remat-worker", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        sys.exit(1)
    except click.UsageError as exc:
        click.echo(f"remat-worker: error: {' '.join(exc.format_message().split())}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
