"""The Celery tasks: a profiling job and a planning job, each from its job id to stored plans and a finished job.

Thin over the pipeline (``remat.worker.pipeline``) and the job state machine (``remat.service.jobs``):

1. claim the job's lease on its row (NOTE [job lease] in service/models.py): a message for a job that is
   finished, follows another, or runs elsewhere under a live lease is acknowledged and dropped — that is what
   makes re-deliveries harmless;
2. run, while a heartbeat thread renews the lease and records progress (phase, fraction);
3. write the trace, plans, measurements *and* the job's end in one transaction, conditional on still holding
   the lease — a worker that lost its job to another writes nothing.

Failures a person can act on (out of memory, a model that cannot be cut, a time limit) end the job ``failed``
with that reason and are not retried; a database that cannot be reached is retried with backoff (the claim by
Celery, the final write alone here: NOTE [final write]); a process killed mid-job is recovered by the lease
lapsing (``remat.worker.reaper``). torch is imported inside the tasks, never in the worker's parent process
(CUDA and fork do not mix).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from celery import Task
from celery.exceptions import SoftTimeLimitExceeded
from sqlalchemy.exc import OperationalError as DatabaseUnreachable
from sqlalchemy.orm import Session

from remat.client.errors import ModelError, RematError
from remat.client.job_state import JobState
from remat.client.plan_key import PlanKey
from remat.client.request import ModelRequest
from remat.service import jobs, repository
from remat.service.config import ServiceSettings
from remat.service.records import PlanRecord
from remat.service.store import PlanStore

__all__ = ["plan_trace", "profile_model"]

log = logging.getLogger("remat.worker")

MAX_DATABASE_RETRIES = 5


class LeaseLost(Exception):
    """Another worker took the job over (our lease lapsed): stop, write nothing."""


def owner_name() -> str:
    """Who holds a lease: host and process, so a re-delivery to a new child of the same worker is a new owner."""
    return f"{socket.gethostname()}:{os.getpid()}"


_stores: dict[tuple[int, str], PlanStore] = {}


def plan_store(settings: ServiceSettings) -> PlanStore:
    """The process's plan store, opened in this process (never inherited across a fork)."""
    slot = (os.getpid(), settings.database_url)
    if slot not in _stores:
        _stores[slot] = PlanStore(settings=settings, use_cache=True).open()
    return _stores[slot]


@dataclass
class Heartbeat:
    """Renews a job's lease every third of it from a thread, carrying the latest progress with it.

    ``progress()`` is the pipeline's callback: it records the phase and wakes the thread to write it at once;
    once the lease is lost it raises :class:`LeaseLost`, which stops the pipeline at its next phase.
    """

    store: PlanStore
    job_id: str
    owner: str
    lease_s: float
    _message: str | None = None
    _fraction: float | None = None
    _plan_key: Mapping[str, Any] | None = None
    _wake: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    lost: bool = False

    def __enter__(self) -> Heartbeat:
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{self.job_id}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def progress(self, message: str, fraction: float) -> None:
        if self.lost:
            raise LeaseLost(self.job_id)
        self._message, self._fraction = message, min(max(fraction, 0.0), 0.99)
        self._wake.set()

    def plan_key(self, key: PlanKey) -> None:
        self._plan_key = key.to_dict()
        self._wake.set()

    @property
    def recorded_key(self) -> Mapping[str, Any] | None:
        """The plan key, once the model was built (a failed job keeps it too)."""
        return self._plan_key

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(timeout=self.lease_s / 3)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                with self.store.db.write_session() as session:
                    held = jobs.heartbeat(session=session, job_id=self.job_id, owner=self.owner,
                                          lease_s=self.lease_s, progress=self._fraction, message=self._message,
                                          plan_key=self._plan_key)
            except DatabaseUnreachable as exc:  # try again next beat; the lease has slack for two misses
                log.warning("job %s: heartbeat failed (%s)", self.job_id, exc)
                continue
            if not held:
                log.warning("job %s: lease lost to another worker; stopping", self.job_id)
                self.lost = True
                return


def _plan_entries(records: list[PlanRecord]) -> list[dict[str, Any]]:
    return [{"plan": r.plan.to_dict(), "measurement": r.measurements[0].to_dict() if r.measurements else None}
            for r in records]


FINAL_WRITE_ATTEMPTS = 4
FINAL_WRITE_BACKOFF_S = 0.5
"""The wait after the first failed attempt at a job's final write, doubled after each later one (0.5, 1, 2 s)."""

Write = Callable[[Session], tuple[Mapping[str, Any], str]]
"""A job's rows, written inside its final transaction; returns the job's result and its closing message."""


def _finish_once(store: PlanStore, job_id: str, owner: str, *, state: str, result: Mapping[str, Any] | None,
                 error: str | None, message: str | None, plan_key: Mapping[str, Any] | None,
                 write: Write | None) -> None:
    """One transaction: ``write``'s rows and the job's end (with its followers); LeaseLost rolls it back."""
    with store.db.write_session() as session:
        if write is not None:
            result, message = write(session)
        if not jobs.finish_job(session=session, job_id=job_id, owner=owner, state=state, result=result,
                               error=error, message=message, plan_key=plan_key):
            raise LeaseLost(job_id)  # rolls the whole transaction back


def _first_line(exc: BaseException) -> str:
    """A database error's own first line (the driver's, without SQLAlchemy's SQL and link)."""
    return (str(getattr(exc, "orig", None) or exc).splitlines() or [""])[0][:300]


def _finish(store: PlanStore, job_id: str, owner: str, *, state: str, result: Mapping[str, Any] | None = None,
            error: str | None = None, message: str | None = None, plan_key: Mapping[str, Any] | None = None,
            write: Write | None = None) -> str:
    """End the job (and its followers) in one transaction with ``write``'s rows, if the lease is still ours.

    Returns ``finished``, ``lease lost`` (nothing written) or ``write failed`` (the job ended ``failed`` without
    the rows, its error saying why).

    NOTE [final write]: the end comes after minutes of work. A database error there (a dropped connection, a
    failover, a deadlock, SQLite busy past its timeout) used to escape the task: the lease lapsed, the reaper
    ran the whole job again, and after the last attempt it failed as "the worker was lost N times" — blaming
    the worker for the database. Now the write alone is retried, ``FINAL_WRITE_ATTEMPTS`` times with backoff,
    while the heartbeat keeps the lease; when it still fails, or fails in a way no retry mends, the job ends
    ``failed`` in a small transaction of its own with an error naming the write. Only when even that cannot be
    written (the database is down) does the error escape, and the lease machinery takes over as before.
    """
    failure: BaseException | None = None
    for attempt in range(1, FINAL_WRITE_ATTEMPTS + 1):
        try:
            _finish_once(store, job_id, owner, state=state, result=result, error=error, message=message,
                         plan_key=plan_key, write=write)
            return "finished"
        except LeaseLost:
            log.warning("job %s: lease lost before the end; nothing written", job_id)
            return "lease lost"
        except DatabaseUnreachable as exc:
            failure = exc
            if attempt == FINAL_WRITE_ATTEMPTS:
                break
            delay_s = FINAL_WRITE_BACKOFF_S * 2 ** (attempt - 1)
            log.warning("job %s: final write failed (%s); attempt %d of %d in %.1f s", job_id,
                        _first_line(exc), attempt + 1, FINAL_WRITE_ATTEMPTS, delay_s)
            time.sleep(delay_s)
        except Exception as exc:  # noqa: BLE001 - not transient (e.g. a value the database refuses): no retry
            if write is None:
                raise
            log.exception("job %s: final write failed", job_id)
            failure = exc
            break
    assert failure is not None
    if write is None:  # nothing smaller to write instead: the database is down
        raise failure
    if isinstance(failure, DatabaseUnreachable):
        reason = (f"could not store the results in the database: the write failed {FINAL_WRITE_ATTEMPTS} times "
                  f"({type(getattr(failure, 'orig', None) or failure).__name__}: {_first_line(failure)}); "
                  f"nothing was stored, submit the job again")
    else:
        reason = (f"could not store the results in the database ({type(failure).__name__}: "
                  f"{_first_line(failure)}); nothing was stored, the worker's log has the details")
    try:
        _finish_once(store, job_id, owner, state=JobState.FAILED, result=None, error=reason,
                     message="failed: the results could not be stored", plan_key=plan_key, write=None)
    except LeaseLost:
        return "lease lost"
    return "write failed"


def _start(task: Task, job_id: str) -> tuple[ServiceSettings, PlanStore, str, jobs.Claim]:
    """Every task's first step: claim the job's lease (a database that cannot be reached is retried)."""
    settings: ServiceSettings = task.app.remat_settings
    store = plan_store(settings)
    owner = owner_name()
    try:
        with store.db.write_session() as session:
            claim = jobs.claim_job(session=session, job_id=job_id, owner=owner, lease_s=settings.job_lease_s,
                                   max_attempts=settings.job_max_attempts)
    except DatabaseUnreachable as exc:
        raise task.retry(exc=exc, countdown=min(60, 2 ** task.request.retries),
                         max_retries=MAX_DATABASE_RETRIES) from None
    if claim.outcome != "run":
        log.info("job %s: %s, nothing to do", job_id, claim.outcome)
    return settings, store, owner, claim


def _failure_reason(exc: BaseException, settings: ServiceSettings, limit_s: int) -> str:
    if isinstance(exc, SoftTimeLimitExceeded):
        return f"time limit: the job ran for more than {limit_s - 30} s (REMAT_TASK_TIME_LIMIT_S)"
    if isinstance(exc, RematError):
        return str(exc)
    first = (str(exc).splitlines() or [""])[0][:500]
    return f"internal error ({type(exc).__name__}: {first}); the worker's log has the details"


def profile_model(task: Task, job_id: str) -> str:
    """Profile, plan and validate the model of job ``job_id``; returns the claim's outcome (for logs)."""
    settings, store, owner, claim = _start(task, job_id)
    if claim.outcome != "run" or claim.job is None:
        return claim.outcome
    from remat.client.graph.built_model import build
    from remat.worker import pipeline
    from remat.worker.local import derive_trace

    with Heartbeat(store, job_id, owner, settings.job_lease_s) as beat:
        refresh = bool(claim.job.request.get("refresh"))  # a zoo run's --refresh: profile even if stored
        try:
            request = ModelRequest.from_dict(claim.job.request)
            if request.source == "hf":
                # The API refuses the rest; a row written some other way must not make a worker read a path,
                # build a name off the allow-list or take unknown configuration fields.
                from remat.client.hf_models import check_service_spec

                check_service_spec(request.spec, request.model_kwargs)
            elif request.source != "torchvision" or request.model_kwargs:
                # The API refuses these; a row written some other way must not make a worker import and
                # call what it names.
                raise ModelError(f"{request.name}: workers build torchvision models with their default "
                                 f"arguments, and hf: models of the allow-list, only")
            beat.progress(f"building {request.name}", 0.0)
            built = build(request)
            beat.plan_key(built.key)  # recorded on the job at once: seconds in, before minutes of profiling
            existing = None if refresh else store.complete_plans(built.key)
            if existing is None:
                # A new batch size of an architecture stored at two others: derived, planned and validated by
                # measured steps, without a profile (remat.client.derived_trace).
                derived = None if refresh else derive_trace(store.size_profiles(built.key), built.key)
                if derived is not None:
                    result = pipeline.run_derived(built, derived, progress=beat.progress)
                else:
                    result = pipeline.run_built(built, progress=beat.progress, certify_s=settings.certify_s)
        except LeaseLost:
            return "lease lost"
        except DatabaseUnreachable:
            raise  # the lease lapses and the reaper sends the job again
        except Exception as exc:  # noqa: BLE001 - every other failure ends the job with its reason
            if not isinstance(exc, (RematError, SoftTimeLimitExceeded)):
                log.exception("job %s: unexpected error", job_id)
            outcome = _finish(store, job_id, owner, state=JobState.FAILED, plan_key=beat.recorded_key,
                              error=_failure_reason(exc, settings, settings.task_time_limit_s))
            return "failed" if outcome == "finished" else outcome
        if existing is not None:  # the key's complete answer is stored: finish with it, profile nothing
            registered = [r for r in existing if not r.plan.budget_bytes]
            outcome = _finish(store, job_id, owner, state=JobState.SUCCEEDED, plan_key=beat.recorded_key,
                              message="done: the plans were already stored",
                              result={"key": registered[0].key.to_dict(), "trace_id": registered[0].trace.trace_id,
                                      "reused": True, "plans": _plan_entries(registered)})
            return "reused" if outcome == "finished" else outcome
        if beat.lost:
            return "lease lost"

        def write(session: Session) -> tuple[Mapping[str, Any], str]:
            stored = repository.store_profile(session=session, trace=result.trace, plans=result.plans,
                                              measurements=result.measurements)
            kept = stored.superseded_by or stored.trace_id  # a newer profile of the key keeps its plans
            records = [r for r in repository.find_plans(session=session, key=stored.key)
                       if r.trace.trace_id == kept]
            answer = {"key": stored.key.to_dict(), "trace_id": kept, "reused": stored.superseded_by is not None,
                      "device_name": result.device_name,
                      "plans": _plan_entries([r for r in records if not r.plan.budget_bytes]),
                      "frontier": _plan_entries(sorted((r for r in records if r.plan.budget_bytes),
                                                       key=lambda r: r.plan.predicted_peak_bytes))}
            if stored.superseded_by is not None:
                return answer, (f"done: a newer profile of this key (trace {stored.superseded_by}) is stored; "
                                f"its plans are the answer, this run's (trace {stored.trace_id}) were not stored")
            registered = [p for p in result.plans if not p.budget_bytes]
            return answer, (f"done: {len(registered)} plans validated, "
                            f"{len(result.plans) - len(registered)} frontier points")

        outcome = _finish(store, job_id, owner, state=JobState.SUCCEEDED, write=write, plan_key=beat.recorded_key)
        if outcome == "finished":
            store.invalidate(result.key, result.plans)
            return "succeeded"
        return outcome


def plan_trace(task: Task, job_id: str) -> str:
    """Run the planners an upload deferred (``cubic``, the frontier on a large trace) and store their plans."""
    settings, store, owner, claim = _start(task, job_id)
    if claim.outcome != "run" or claim.job is None:
        return claim.outcome
    from remat.client.plan import BUDGET_ALGORITHM
    from remat.client.planning.plans import STORED_COST_MODEL, frontier_plans, make_plan, with_points_below_chains

    request = claim.job.request
    with Heartbeat(store, job_id, owner, settings.job_lease_s) as beat:
        try:
            with store.db.read_session() as session:
                trace = repository.load_trace(session=session, trace_id=int(request["trace_id"]))
            if trace is None:
                raise RematError(f"trace {request['trace_id']} is no longer stored")
            plans = []
            algorithms = list(request["algorithms"])
            for k, algorithm in enumerate(algorithms):
                beat.progress(f"planning {algorithm} ({trace.num_stages} stages)", k / len(algorithms))
                if algorithm == BUDGET_ALGORITHM:  # the Pareto frontier: many plans, one per peak
                    plans.extend(frontier_plans(trace))
                else:
                    plans.append(make_plan(trace, algorithm, cost_model=STORED_COST_MODEL))
            plans = with_points_below_chains(plans)  # nested's plan below the chains, when both ran here
        except LeaseLost:
            return "lease lost"
        except DatabaseUnreachable:
            raise
        except Exception as exc:  # noqa: BLE001
            if not isinstance(exc, (RematError, SoftTimeLimitExceeded)):
                log.exception("job %s: unexpected error", job_id)
            outcome = _finish(store, job_id, owner, state=JobState.FAILED,
                              error=_failure_reason(exc, settings, settings.plan_time_limit_s))
            return "failed" if outcome == "finished" else outcome

        superseded: list[int] = []

        def write(session: Session) -> tuple[Mapping[str, Any], str]:
            trace_id = int(request["trace_id"])
            written = repository.store_plans(session=session, trace_id=trace_id, plans=plans)
            key = {"key": written.key.to_dict() if written else None, "trace_id": trace_id}
            if written is not None and written.superseded_by is not None:  # NOTE [latest profile wins]
                superseded[:] = [written.superseded_by]
                return ({**key, "superseded_by": written.superseded_by, "plans": []},
                        f"superseded: trace {trace_id} is no longer the newest of its key (trace "
                        f"{written.superseded_by} is); its {len(plans)} plans were dropped, not stored")
            superseded.clear()  # a retried write may see otherwise
            return {**key, "plans": [{"plan": p.to_dict(), "measurement": None} for p in plans]}, \
                f"done: {len(plans)} plans"

        outcome = _finish(store, job_id, owner, state=JobState.SUCCEEDED, write=write)
        if outcome != "finished":
            return outcome
        if superseded:
            return "superseded"
        store.invalidate(PlanKey.from_trace(trace), plans)
        return "succeeded"

