"""The workers' Celery application: Redis broker, crash-safe delivery, the two tasks, the reaper.

Start a worker with ``remat-worker --queues cpu`` (``remat.worker.cli``) or, equivalently,
``celery -A remat.worker.celery_app worker -Q cpu -c 1``. Settings come from the same ``REMAT_*`` environment
as the service (``remat.service.config``): ``REMAT_BROKER_URL``, ``REMAT_DATABASE_URL``... Job state lives in
the database; there is no result backend.

Delivery (each setting says the trap it avoids; docs/service.md, "Workers", says how a job outlives its worker):
- ``task_acks_late`` + ``task_reject_on_worker_lost``: a message is acknowledged when its task returns, and
  put back when the child running it dies; ``worker_prefetch_multiplier=1`` reserves only what runs.
- The Redis visibility timeout (all three places) is ``REMAT_VISIBILITY_TIMEOUT_S`` (2 h), above every task
  time limit, so a running task is never delivered twice; the lease on the job row, not this timeout, brings
  back the job of a killed worker (``remat.worker.reaper``), within ``job_lease_s + reap_interval_s``.
- Time limits per task (soft 30 s before hard: the job fails with that reason); one task per child process
  on the queues of a device whose backend asks for it (``cuda``), so each job's GPU memory goes back with
  its process.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, Task, signals

from remat.client.devices import ONE_JOB_PER_PROCESS, queue_device
from remat.client.host_memory import keep_freed_memory
from remat.service.celery_client import PLAN_TASK, PROFILE_TASK
from remat.service.config import ServiceSettings
from remat.worker import tasks
from remat.worker.reaper import Reaper

__all__ = ["app", "make_app"]

log = logging.getLogger("remat.worker")

SOFT_LIMIT_MARGIN_S = 30
SOFT_SHUTDOWN_S = 10.0


def make_app(settings: ServiceSettings | None = None) -> Celery:
    """A worker app for ``settings`` (default: from the environment), with both tasks registered."""
    settings = settings or ServiceSettings()
    keep_freed_memory()  # the tasks time training steps on CPU; the prefork pool's children inherit it
    visibility = settings.visibility_timeout_s
    app = Celery("remat-worker", broker=settings.broker_url, set_as_current=False)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options={"visibility_timeout": visibility},
        result_backend_transport_options={"visibility_timeout": visibility},
        visibility_timeout=visibility,
        broker_connection_retry_on_startup=True,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        task_default_queue=settings.queue_name("cpu"),
        task_time_limit=settings.task_time_limit_s,
        worker_soft_shutdown_timeout=SOFT_SHUTDOWN_S,
        worker_hijack_root_logger=False,
    )
    app.remat_settings = settings  # type: ignore[attr-defined]  # read by the tasks

    @app.task(name=PROFILE_TASK, bind=True, shared=False, time_limit=settings.task_time_limit_s,
              soft_time_limit=settings.task_time_limit_s - SOFT_LIMIT_MARGIN_S)
    def profile_model(self: Task, job_id: str) -> str:
        return tasks.profile_model(self, job_id)

    @app.task(name=PLAN_TASK, bind=True, shared=False, time_limit=settings.plan_time_limit_s,
              soft_time_limit=settings.plan_time_limit_s - SOFT_LIMIT_MARGIN_S)
    def plan_trace(self: Task, job_id: str) -> str:
        return tasks.plan_trace(self, job_id)

    return app


def _queue_names(option: Any) -> list[str]:
    if option is None:
        return []
    if isinstance(option, str):
        option = option.split(",")
    return [str(q).strip() for q in option if str(q).strip()]


_reapers: list[Reaper] = []


@signals.celeryd_init.connect(weak=False, dispatch_uid="remat-cuda-children")
def _one_task_per_child_on_gpu(sender: Any = None, instance: Any = None, conf: Any = None, options: Any = None,
                               **_: Any) -> None:
    """A worker consuming a queue of a device in ``ONE_JOB_PER_PROCESS`` (CUDA) replaces its child after every
    task: the caching allocator keeps what a job reserved until the process exits, and the next model may need
    all of it. Decided from device names alone: the worker's main process never imports torch."""
    settings = getattr(getattr(instance, "app", None), "remat_settings", None)
    prefix = settings.queue_prefix if settings is not None else ""
    devices = {queue_device(q.removeprefix(prefix)) for q in _queue_names((options or {}).get("queues"))}
    if devices & ONE_JOB_PER_PROCESS and conf is not None:
        conf.worker_max_tasks_per_child = 1


@signals.worker_ready.connect(weak=False, dispatch_uid="remat-reaper-start")
def _start_reaper(sender: Any = None, **_: Any) -> None:
    settings = getattr(getattr(sender, "app", None), "remat_settings", None)
    if settings is None:
        return
    reaper = Reaper(settings)
    reaper.start()
    _reapers.append(reaper)
    log.info("remat reaper: every %.0f s, leases of %.0f s", settings.reap_interval_s, settings.job_lease_s)


@signals.worker_process_init.connect(weak=False, dispatch_uid="remat-after-fork")
def _after_fork(**_: Any) -> None:
    for reaper in _reapers:
        reaper.after_fork()


@signals.worker_shutdown.connect(weak=False, dispatch_uid="remat-reaper-stop")
def _stop_reaper(**_: Any) -> None:
    for reaper in _reapers:
        reaper.stop()


app = make_app()
"""For ``celery -A remat.worker.celery_app worker``; ``remat-worker`` builds its own from its options."""
