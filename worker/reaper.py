"""Send jobs to the broker again when their worker died or their message was lost.

Every worker runs one reaper thread in its parent process (started on ``worker_ready``). It is what brings a
job back within ``job_lease_s + reap_interval_s`` when the process running it is killed — the child alone (the
kernel's OOM killer) or the whole worker with it (a lost node, where nothing is acknowledged and Redis would
re-deliver only after the visibility timeout, hours later). It also sends jobs the API could not hand to a
dead broker. Several reapers may run at once: ``jobs.reap_jobs`` changes each row conditionally, so a job is
re-sent once; a duplicate message would be harmless anyway (the lease lets one worker run the job).
"""

from __future__ import annotations

import logging
import threading

from sqlalchemy.exc import SQLAlchemyError

from remat.client.job_state import JobState
from remat.service import jobs
from remat.service.celery_client import JobQueue, send_job
from remat.service.config import ServiceSettings
from remat.service.store import PlanStore

log = logging.getLogger("remat.worker.reaper")


def reap_once(store: PlanStore, queue: JobQueue, settings: ServiceSettings) -> int:
    """One pass: mark the due jobs queued (one transaction), then send them; returns how many were sent."""
    with store.db.write_session() as session:
        due = jobs.reap_jobs(session=session, requeue_after_s=settings.requeue_after_s,
                             pending_after_s=settings.pending_resend_after_s)
    sent = 0
    for job in due:
        if send_job(store.db, queue, job).state == JobState.PENDING:
            continue  # the broker refused it: waiting for the broker, sent again next time
        sent += 1
        log.info("job %s sent to %s again (%s)", job.id, job.queue, job.message)
    return sent


class Reaper(threading.Thread):
    """A daemon thread calling :func:`reap_once` every ``reap_interval_s`` until stopped."""

    def __init__(self, settings: ServiceSettings) -> None:
        super().__init__(name="remat-reaper", daemon=True)
        self.settings = settings
        self.store = PlanStore(settings=settings)
        self.queue = JobQueue(settings)
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.settings.reap_interval_s):
            try:
                reap_once(self.store, self.queue, self.settings)
            except SQLAlchemyError as exc:  # the database is down: try again next round
                log.warning("reaper: database unavailable (%s)", str(exc).splitlines()[0])
            except Exception:  # noqa: BLE001 - a reaper that dies silently would strand every lost job
                log.exception("reaper: unexpected error")

    def stop(self) -> None:
        self._stop_event.set()

    def after_fork(self) -> None:
        """In a forked child: forget the parent's connections without closing them under the parent."""
        if self.store.is_open:
            self.store.db.forget_after_fork()
