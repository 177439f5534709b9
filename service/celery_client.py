"""Hand jobs to the workers through the Celery broker, by task name only.

The service never imports the worker's tasks (they pull in torch); it sends a task name with the job id as
the one argument, and the worker re-reads the job from the database (a thin task: a re-delivered message
carries no stale copy of the job). The broker connection uses short timeouts and no retries: a dead broker
must turn into a job that waits for it (``pending``, sent again by a worker's reaper), never into a hung or
failed HTTP request.

The task names are defined here, once: the worker registers its tasks under them (``remat.worker.tasks``).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import redis
from kombu.exceptions import OperationalError
from redis.backoff import NoBackoff
from redis.retry import Retry

from remat.service import jobs
from remat.service.config import ServiceSettings
from remat.service.db import Database
from remat.service.records import JobRecord

if TYPE_CHECKING:
    from celery import Celery

PROFILE_TASK = "worker.profile_model"
"""Profile a zoo model, plan it with every algorithm, validate every plan (queues ``cpu``, ``cuda``...)."""
PLAN_TASK = "worker.plan_trace"
"""Run the planners too slow for an upload on a stored trace (queue ``plan``)."""
TASK_FOR_KIND = {"profile": PROFILE_TASK, "plan": PLAN_TASK}
PLAN_QUEUE = "plan"


class JobQueue:
    """A lazily created Celery client that can only send tasks (the API's and the reaper's)."""

    def __init__(self, settings: ServiceSettings) -> None:
        self._settings = settings
        self._app: Celery | None = None
        self._lock = threading.Lock()

    def _celery(self) -> Celery:
        with self._lock:
            if self._app is None:
                from celery import Celery  # import cost only for processes that enqueue

                timeout = self._settings.broker_timeout_s
                app = Celery("remat-service", broker=self._settings.broker_url, set_as_current=False)
                app.conf.update(
                    broker_connection_timeout=timeout,
                    broker_connection_retry=False,
                    broker_connection_max_retries=0,
                    broker_transport_options={"socket_timeout": timeout, "socket_connect_timeout": timeout,
                                              "max_retries": 0,
                                              "visibility_timeout": self._settings.visibility_timeout_s},
                    task_serializer="json",
                    accept_content=["json"],
                )
                self._app = app
            return self._app

    def enqueue(self, kind: str, job_id: str, queue: str) -> str | None:
        """Send the task of a ``kind`` job to ``queue``; None on success, else why the broker refused it.

        The Celery task id is the job id, so broker-side tooling and the database name the same thing.
        """
        try:
            self._celery().send_task(TASK_FOR_KIND[kind], args=[job_id], task_id=job_id, retry=False,
                                     queue=self._settings.queue_name(queue))
        except (OperationalError, OSError, redis.RedisError) as exc:
            return f"broker {self._settings.broker_url_redacted} unreachable: {exc}"
        return None

    def ping(self) -> str | None:
        """None when the broker answers, else the error (for ``/healthz``); the broker is Redis."""
        timeout = self._settings.broker_timeout_s
        client = redis.Redis.from_url(self._settings.broker_url, socket_timeout=timeout,
                                      socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0))
        try:
            client.ping()
        except (redis.RedisError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}".splitlines()[0]
        finally:
            client.close()
        return None

    def close(self) -> None:
        with self._lock:
            if self._app is not None:
                self._app.close()
                self._app = None


def send_job(db: Database, queue: JobQueue, job: JobRecord) -> JobRecord:
    """Hand a committed job to the broker and record the outcome (``jobs.record_send``); the API after a
    submission and the workers' reaper both send jobs through here."""
    target = job.queue or "cpu"
    error = queue.enqueue(job.kind, job.id, target)
    with db.write_session() as session:
        return jobs.record_send(session=session, job_id=job.id, queue=target, error=error) or job
