"""The job table's state machine: creation with deduplication, leases, heartbeats, completion, reaping.

Shared by the API (creates jobs and answers for them) and the workers (claim, renew, finish, reap); every
function works inside the caller's transaction, like the rest of the repository. NOTE [job lease] in
models.py explains why a lease and not the broker decides who runs a job.

States: ``remat.client.job_state.JobState`` (pending, queued, running, succeeded, failed), the vocabulary the
CLI prints too.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased, defer

from remat.client.job_state import ACTIVE_JOB_STATES, FINISHED_JOB_STATES, JobState
from remat.service.models import JobRow, utcnow
from remat.service.records import JobRecord

__all__ = ["Claim", "claim_job", "create_job", "finish_job", "get_job", "heartbeat", "job_record", "list_jobs",
           "reap_jobs", "recent_jobs", "record_send", "release_job", "update_job"]


def job_record(row: JobRow, *, result: bool = True) -> JobRecord:
    """The record of a ``jobs`` row; ``result=False`` when the row was read without its result."""
    return JobRecord(id=row.id, kind=row.kind, state=row.state, progress=row.progress, message=row.message,
                     error=row.error, request=row.request, result=row.result if result else None,
                     created_at=row.created_at,
                     updated_at=row.updated_at, started_at=row.started_at, finished_at=row.finished_at,
                     queue=row.queue, leader_id=row.leader_id, attempts=row.attempts, lease_owner=row.lease_owner,
                     lease_expires_at=row.lease_expires_at, plan_key=row.plan_key)


def _active_leader(session: Session, request_key: str) -> JobRow | None:
    """The active leader of ``request_key``, share-locked until the caller's transaction ends.

    NOTE [follower lock]: a follower must be committed before its leader finishes, or after it and not at
    all. Finishing takes the leader row ``FOR UPDATE`` (``finish_job``, ``claim_job``'s give-up) and then
    finishes the followers it can see; this read takes the same row ``FOR SHARE``, so a leader cannot finish
    between it and the follower's commit (the finisher waits, then sees the follower). If the leader is being
    finished when we read, PostgreSQL waits for that commit and re-checks the ``WHERE`` on the new row: a
    leader that ended no longer matches, and the new job leads instead. Share locks do not conflict with one
    another, so concurrent submissions following the same leader (zoo batches) never wait on each other.
    SQLite ignores the clause; its write transactions are serial anyway (NOTE [SQLite write transactions]).
    """
    stmt = (select(JobRow).where(JobRow.request_key == request_key, JobRow.leader_id.is_(None),
                                 JobRow.state.in_(ACTIVE_JOB_STATES))
            .with_for_update(read=True).execution_options(populate_existing=True))
    return session.execute(stmt).scalars().first()


def create_job(*, session: Session, request: Mapping[str, Any], kind: str = "profile",
               request_key: str | None = None, queue: str | None = None) -> tuple[JobRecord, bool]:
    """Record a job; returns it and whether the caller must enqueue it (after commit).

    A job whose ``request_key`` equals that of an active job *follows* it: it is recorded ``queued`` with
    ``leader_id`` set, is not enqueued, and finishes when its leader does, with the same result; the leader's
    row is share-locked from the read to the commit (NOTE [follower lock]), so it cannot finish unseen in
    between. The partial unique index ``uq_jobs_active_request`` makes two concurrent first submissions safe:
    the second insert of a leader fails, and that submission becomes a follower instead.
    """
    now = utcnow()
    for _ in range(3):
        leader = _active_leader(session, request_key) if request_key else None
        row = JobRow(id=str(uuid.uuid4()), kind=kind, request=dict(request), request_key=request_key, queue=queue,
                     created_at=now, updated_at=now, progress=0.0)
        if leader is not None:
            row.state, row.leader_id = JobState.QUEUED, leader.id
            row.message = f"follows job {leader.id}, which runs the same request"
        else:
            row.state = JobState.PENDING
        try:
            with session.begin_nested():
                session.add(row)
                session.flush()
        except IntegrityError:
            continue  # another submission became the leader between our query and our insert
        return job_record(row), leader is None
    raise RuntimeError("jobs: could not record the job after 3 tries (concurrent submissions)")


def get_job(*, session: Session, job_id: str) -> JobRecord | None:
    row = session.get(JobRow, job_id)
    return job_record(row) if row is not None else None


def update_job(*, session: Session, job_id: str, state: str | None = None, progress: float | None = None,
               message: str | None = None, error: str | None = None, result: Mapping[str, Any] | None = None,
               only_from: Sequence[str] | None = None, enqueued: bool = False) -> JobRecord | None:
    """Advance a job; None when it does not exist.

    ``only_from`` makes the update conditional on the current state, so that a late "queued" from the API
    cannot overwrite the worker's "running" (the worker may start before the API has recorded the enqueue);
    when the condition fails the job is returned unchanged. ``enqueued`` records that it was just sent.
    """
    if state is not None and state not in tuple(JobState):
        raise ValueError(f"state: must be one of {', '.join(JobState)}, got {state!r}")
    row = session.get(JobRow, job_id, with_for_update=True)
    if row is None:
        return None
    if only_from is not None and row.state not in only_from:
        return job_record(row)
    now = utcnow()
    if state is not None:
        if state == JobState.RUNNING and row.started_at is None:
            row.started_at = now
        if state in FINISHED_JOB_STATES:
            row.finished_at = now
        row.state = state
    for name, value in (("progress", progress), ("message", message), ("error", error)):
        if value is not None:
            setattr(row, name, value)
    if result is not None:
        row.result = dict(result)
    if enqueued:
        row.enqueued_at = now
    row.updated_at = now
    session.flush()
    return job_record(row)


def list_jobs(*, session: Session, state: str | None = None, limit: int = 50,
              offset: int = 0) -> tuple[list[JobRecord], int]:
    """A page of jobs, newest first, and how many match in all."""
    stmt = select(JobRow)
    if state is not None:
        stmt = stmt.where(JobRow.state == state)
    total = session.execute(select(func.count()).select_from(stmt.subquery())).scalar_one()
    rows = session.execute(stmt.order_by(JobRow.created_at.desc(), JobRow.id).limit(limit).offset(offset))
    return [job_record(r) for r in rows.scalars()], total


def recent_jobs(*, session: Session, state: str | None = None, limit: int = 50,
                offset: int = 0) -> tuple[list[JobRecord], bool]:
    """A page of jobs, newest first, without their results (``result`` is None), and whether more follow.

    For pages that list jobs: a finished job's result holds every plan with its measurements and timelines,
    tens of kilobytes each, and no count of the whole table is taken (``ix_jobs_created_at`` is walked to
    the page and one row past it).
    """
    stmt = select(JobRow).options(defer(JobRow.result, raiseload=True))
    if state is not None:
        stmt = stmt.where(JobRow.state == state)
    rows = list(session.execute(stmt.order_by(JobRow.created_at.desc(), JobRow.id)
                                .limit(limit + 1).offset(offset)).scalars())
    return [job_record(r, result=False) for r in rows[:limit]], len(rows) > limit


@dataclass(frozen=True, slots=True)
class Claim:
    """What ``claim_job`` decided: ``run`` (the lease is ours), ``finished``, ``follower`` (its leader runs it),
    ``busy`` (another worker holds a live lease; try again after ``retry_after_s``), ``gave_up`` (too many lost
    attempts: now failed) or ``missing``."""

    outcome: str
    job: JobRecord | None = None
    retry_after_s: float = 0.0


def _finish(session: Session, row: JobRow, *, state: str, now: datetime, result: Mapping[str, Any] | None,
            error: str | None, message: str | None) -> None:
    """Finish ``row`` and every job following it, identically."""
    followers = session.execute(select(JobRow).where(JobRow.leader_id == row.id,
                                                     JobRow.state.not_in(FINISHED_JOB_STATES))).scalars().all()
    row.state, row.finished_at, row.updated_at = state, now, now
    row.lease_owner = row.lease_expires_at = None
    row.error, row.message = error, message
    if result is not None:
        row.result = dict(result)
    if state == JobState.SUCCEEDED:
        row.progress = 1.0
    row.started_at = row.started_at or now
    for job in followers:
        _end_with_leader(job, row, now=now)


def _end_with_leader(job: JobRow, leader: JobRow, *, now: datetime) -> None:
    """End follower ``job`` as its finished ``leader`` ended: same state, result, error and plan key."""
    job.state, job.finished_at, job.updated_at = leader.state, now, now
    job.lease_owner = job.lease_expires_at = None
    job.error = leader.error
    job.message = f"{leader.message} (with job {leader.id}, same request)"
    if leader.result is not None:
        job.result = dict(leader.result)
    if leader.state == JobState.SUCCEEDED:
        job.progress = 1.0
    if job.started_at is None:
        job.started_at = leader.started_at or now
    if leader.plan_key is not None:
        job.plan_key = leader.plan_key


def claim_job(*, session: Session, job_id: str, owner: str, lease_s: float, max_attempts: int) -> Claim:
    """Take the job's lease if nobody holds a live one (NOTE [job lease]); counts the attempt."""
    row = session.get(JobRow, job_id, with_for_update=True)
    if row is None:
        return Claim("missing")
    if row.state in FINISHED_JOB_STATES:
        return Claim("finished", job_record(row))
    if row.leader_id is not None:
        return Claim("follower", job_record(row))
    now = utcnow()
    if row.state == JobState.RUNNING and row.lease_owner not in (None, owner) and row.lease_expires_at is not None \
            and row.lease_expires_at > now:
        return Claim("busy", job_record(row), (row.lease_expires_at - now).total_seconds())
    if row.attempts >= max_attempts:
        _finish(session, row, state=JobState.FAILED, now=now, result=None, message="gave up",
                error=f"the worker running this job was lost {row.attempts} times in a row (killed, e.g. by the "
                      f"kernel's out-of-memory killer, or its node went away); not trying again")
        session.flush()
        return Claim("gave_up", job_record(row))
    row.state, row.attempts, row.lease_owner = JobState.RUNNING, row.attempts + 1, owner
    row.lease_expires_at = now + timedelta(seconds=lease_s)
    row.started_at = row.started_at or now
    row.updated_at = now
    row.message = f"attempt {row.attempts} on {owner}"
    session.flush()
    return Claim("run", job_record(row))


def heartbeat(*, session: Session, job_id: str, owner: str, lease_s: float, progress: float | None = None,
              message: str | None = None, plan_key: Mapping[str, Any] | None = None) -> bool:
    """Renew the lease (and record progress) if ``owner`` still holds it; False when it does not any more."""
    now = utcnow()
    values: dict[str, Any] = {"lease_expires_at": now + timedelta(seconds=lease_s), "updated_at": now}
    if progress is not None:
        values["progress"] = progress
    if message is not None:
        values["message"] = message
    if plan_key is not None:
        values["plan_key"] = dict(plan_key)
    result = session.execute(update(JobRow).where(JobRow.id == job_id, JobRow.lease_owner == owner,
                                                  JobRow.state == JobState.RUNNING).values(**values))
    return result.rowcount == 1


def finish_job(*, session: Session, job_id: str, owner: str, state: str, result: Mapping[str, Any] | None = None,
               error: str | None = None, message: str | None = None,
               plan_key: Mapping[str, Any] | None = None) -> bool:
    """Finish a job (and its followers) if ``owner`` holds its lease; False otherwise, and nothing is written.

    Called in the same transaction as the job's output, so a worker that lost its lease (another took the job
    over) rolls its whole write back.
    """
    if state not in FINISHED_JOB_STATES:
        raise ValueError(f"state: must be one of {', '.join(FINISHED_JOB_STATES)}, got {state!r}")
    row = session.get(JobRow, job_id, with_for_update=True)
    if row is None or row.state != JobState.RUNNING or row.lease_owner != owner:
        return False
    if plan_key is not None:
        row.plan_key = dict(plan_key)
    _finish(session, row, state=state, now=utcnow(), result=result, error=error,
            message=message or ("done" if state == JobState.SUCCEEDED else "failed"))
    session.flush()
    return True


def release_job(*, session: Session, job_id: str, owner: str, message: str) -> bool:
    """Give the lease back without finishing (a transient error; the task will be retried)."""
    now = utcnow()
    result = session.execute(update(JobRow).where(JobRow.id == job_id, JobRow.lease_owner == owner,
                                                  JobRow.state == JobState.RUNNING)
                             .values(state=JobState.QUEUED, lease_owner=None, lease_expires_at=None, message=message,
                                     updated_at=now, enqueued_at=now))
    return result.rowcount == 1


def reap_jobs(*, session: Session, requeue_after_s: float, pending_after_s: float,
              now: datetime | None = None) -> list[JobRecord]:
    """Jobs to send to the broker again; marks them ``queued`` (the caller sends them after commit).

    - ``running`` with a lapsed lease: its worker died (or was cut off) without finishing it;
    - ``pending`` leaders older than ``pending_after_s``: the API could not reach the broker, or stopped
      between recording and sending;
    - ``queued`` leaders that no worker took for ``requeue_after_s``: the broker lost the message (a Redis
      restart without persistence). A duplicate message is harmless: the lease lets one worker run the job.
    Each row is changed by a conditional update, so concurrent reapers re-enqueue a job once.

    Followers are never sent, but one whose leader has ended (or is gone) is ended here, as its leader ended:
    nothing else would ever finish it (``_end_stranded_followers``).
    """
    now = now or utcnow()
    sent_at = func.coalesce(JobRow.enqueued_at, JobRow.created_at)
    guards = {
        JobState.RUNNING: (JobRow.state == JobState.RUNNING) & (JobRow.lease_expires_at < now),
        JobState.PENDING: (JobRow.state == JobState.PENDING) & (sent_at < now - timedelta(seconds=pending_after_s)),
        JobState.QUEUED: (JobRow.state == JobState.QUEUED) & (sent_at < now - timedelta(seconds=requeue_after_s)),
    }
    messages = {JobState.RUNNING: "queued again: the worker running it stopped renewing its lease",
                JobState.PENDING: "sent to the broker",
                JobState.QUEUED: "sent to the broker again: no worker took it"}
    _end_stranded_followers(session, now=now)
    candidates = session.execute(select(JobRow.id, JobRow.state).where(JobRow.leader_id.is_(None),
                                                                      or_(*guards.values()))).all()
    out = []
    for job_id, state in candidates:
        changed = session.execute(update(JobRow).where(JobRow.id == job_id, guards[state]).values(
            state=JobState.QUEUED, lease_owner=None, lease_expires_at=None, enqueued_at=now, updated_at=now,
            message=messages[state])).rowcount
        if changed:
            row = session.get(JobRow, job_id)
            if row is not None:
                session.refresh(row)
                out.append(job_record(row))
    return out


def _end_stranded_followers(session: Session, *, now: datetime) -> int:
    """End every unfinished follower whose leader has finished or is gone; returns how many.

    Defence in depth behind NOTE [follower lock]: whatever lets a follower outlive its leader (a finish that
    did not see it, a leader ended by a plain ``update_job``, a row written by hand), such a job would wait
    forever — ``status --wait`` never returns, a zoo batch never ends. Each follower is locked and re-read
    before it is changed, so a concurrent reaper or finisher ends it once.
    """
    leader = aliased(JobRow)
    stranded = session.execute(
        select(JobRow.id, JobRow.leader_id).outerjoin(leader, JobRow.leader_id == leader.id)
        .where(JobRow.leader_id.is_not(None), JobRow.state.not_in(FINISHED_JOB_STATES),
               or_(leader.id.is_(None), leader.state.in_(FINISHED_JOB_STATES)))).all()
    ended = 0
    for job_id, leader_id in stranded:
        job = session.get(JobRow, job_id, with_for_update=True, populate_existing=True)
        if job is None or job.state in FINISHED_JOB_STATES:
            continue
        lead = session.get(JobRow, leader_id) if leader_id is not None else None  # finished: it stays so
        if lead is None:
            job.state, job.finished_at, job.updated_at = JobState.FAILED, now, now
            job.error = job.message = f"the job it followed ({leader_id}) is gone; submit the request again"
            job.started_at = job.started_at or now
        else:
            _end_with_leader(job, lead, now=now)
        ended += 1
    session.flush()
    return ended


def record_send(*, session: Session, job_id: str, queue: str, error: str | None) -> JobRecord | None:
    """Record the outcome of handing a committed job to the broker; None when the job does not exist.

    Sent: a ``pending`` job becomes ``queued`` (one a reaper marked ``queued`` stays so). Refused: the job is
    ``pending``, waiting for the broker, and a reaper sends it again after ``pending_resend_after_s``. Both are
    conditional on the job not having moved on: a fast worker may already run it.
    """
    now = utcnow()
    if error is None:
        stmt = update(JobRow).where(JobRow.id == job_id, JobRow.state == JobState.PENDING).values(
            state=JobState.QUEUED, enqueued_at=now, updated_at=now, message=f"queued on {queue}")
    else:
        stmt = update(JobRow).where(JobRow.id == job_id, JobRow.state.in_((JobState.PENDING, JobState.QUEUED)),
                                    JobRow.lease_owner.is_(None)).values(
            state=JobState.PENDING, updated_at=now, message=f"waiting for the broker ({error})")
    session.execute(stmt)
    return get_job(session=session, job_id=job_id)
