"""Hand profiling jobs to the workers through the Celery broker, by task name only.

The service never imports the worker's tasks (they pull in torch); it sends ``worker.profile_model`` with
the job id as the one argument, and the worker re-reads the job from the database (style.md, thin tasks).
The broker connection uses short timeouts and no retries: a dead broker must turn into a recorded job
error within ``broker_timeout_s``, never into a hung or failed HTTP request.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kombu.exceptions import OperationalError

from remat.service.config import ServiceSettings

if TYPE_CHECKING:
    from celery import Celery

PROFILE_TASK = "worker.profile_model"


class JobQueue:
    """A lazily created Celery client that can only send tasks."""

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
                                              "max_retries": 0},
                    task_serializer="json",
                    accept_content=["json"],
                )
                self._app = app
            return self._app

    def enqueue_profile(self, job_id: str) -> str | None:
        """Send the profiling task for ``job_id``; None on success, else why the broker refused it.

        The Celery task id is the job id, so broker-side tooling and the database name the same thing.
        """
        try:
            self._celery().send_task(PROFILE_TASK, args=[job_id], task_id=job_id, retry=False,
                                     queue=self._settings.job_queue)
        except (OperationalError, OSError) as exc:
            return f"broker {self._settings.broker_url_redacted} unreachable: {exc}"
        return None

    def close(self) -> None:
        with self._lock:
            if self._app is not None:
                self._app.close()
                self._app = None
