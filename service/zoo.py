"""Zoo batches: one ``POST /v1/zoo`` makes a profiling job per selected model; ``GET /v1/zoo/{id}`` reads
their progress and per-model rows back.

The jobs stay the one record of each model's run (dedup, leases, reaping all apply as to a single
``POST /v1/jobs``); a batch only remembers which jobs are its models. Its rows are ``remat.client.zoo_batch
.ZooRow``s built from the finished jobs, the same rows ``remat-client zoo`` prints in embedded mode.
Functions work inside the caller's transaction, like the repository's.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, defer

from remat.client.job_state import FINISHED_JOB_STATES, JobState
from remat.client.request import ModelRequest
from remat.client.zoo_batch import ZooRow
from remat.service import jobs
from remat.service.lru import LruCache
from remat.service.models import JobRow, ZooBatchJobRow, ZooBatchRow, utcnow
from remat.service.records import JobRecord

__all__ = ["ZooBatch", "ZooBatchSummary", "create_batch", "get_batch", "job_request_key", "recent_batches"]


def job_request_key(request: ModelRequest, *, refresh: bool) -> str:
    """The dedup key of a model's job: equal requests share one run; a refresh is its own run."""
    if not refresh:
        return request.fingerprint
    return hashlib.sha256(f"{request.fingerprint}:refresh".encode()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class ZooBatch:
    """A zoo batch with its jobs, in the order of the selection, and the row of each finished one."""

    id: str
    zoo: str
    filter: str | None
    request: Mapping[str, Any]
    created_at: datetime
    models: tuple[str, ...]
    jobs: tuple[JobRecord, ...]
    """Read without their results (``result`` is None): a finished one's is summarised in ``rows``."""
    rows: Mapping[str, ZooRow | None]
    """By job id, each finished job's row (None for a finished job whose result reads as no row)."""

    def to_dict(self) -> dict[str, Any]:
        """``GET /v1/zoo/{id}``: counts per state, overall progress and a row per model once it finished."""
        counts = dict.fromkeys((state.value for state in JobState), 0)
        entries = []
        for model, job in zip(self.models, self.jobs, strict=True):
            counts[job.state] += 1
            row = self.rows.get(job.id) if job.state in FINISHED_JOB_STATES else None
            entries.append({"model": model, "job_id": job.id, "state": job.state,
                            "progress": 1.0 if job.state in FINISHED_JOB_STATES else job.progress,
                            "message": job.message, "row": row.to_dict() if row is not None else None})
        total = len(self.jobs)
        finished = sum(counts[state] for state in FINISHED_JOB_STATES)
        return {"id": self.id, "zoo": self.zoo, "filter": self.filter, "request": dict(self.request),
                "created_at": self.created_at.isoformat(), "total": total, "finished": finished,
                "counts": counts, "done": finished == total,
                "progress": sum(e["progress"] for e in entries) / total if total else 1.0, "models": entries}


def create_batch(*, session: Session, zoo: str, filter: str | None, template: Mapping[str, Any],
                 requests: Sequence[ModelRequest], queue: str, refresh: bool) -> tuple[ZooBatch, list[JobRecord]]:
    """Record a batch and a job per request; returns it and the jobs the caller must send (after commit)."""
    batch = ZooBatchRow(id=str(uuid.uuid4()), zoo=zoo, filter=filter, request=dict(template), created_at=utcnow())
    session.add(batch)
    session.flush()
    to_send: list[JobRecord] = []
    for position, request in enumerate(requests):
        body = request.to_dict()
        if refresh:
            body["refresh"] = True
        job, must_send = jobs.create_job(session=session, request=body, kind="profile", queue=queue,
                                         request_key=job_request_key(request, refresh=refresh))
        session.add(ZooBatchJobRow(batch_id=batch.id, position=position, model=request.name, job_id=job.id))
        if must_send:
            to_send.append(job)
    session.flush()
    found = get_batch(session=session, batch_id=batch.id)
    assert found is not None
    return found, to_send


def get_batch(*, session: Session, batch_id: str, rows: LruCache[ZooRow | None] | None = None) -> ZooBatch | None:
    """A batch, its jobs and the rows of the finished ones.

    A finished job's result holds every plan with its measurements (tens of kilobytes of JSON) and never changes:
    with ``rows``, a cache of rows by (job, finish time), only the results of finished jobs it does not hold yet
    are read, in one query, and a batch page read again reads none.
    """
    row = session.get(ZooBatchRow, batch_id)
    if row is None:
        return None
    ids = [entry.job_id for entry in row.jobs]
    found = {job.id: jobs.job_record(job, result=False) for job in session.execute(
        select(JobRow).where(JobRow.id.in_(ids)).options(defer(JobRow.result, raiseload=True))).scalars()}
    if any(job_id not in found for job_id in ids):  # the foreign keys make this impossible; say so if it happens
        raise RuntimeError(f"zoo batch {batch_id}: a job of the batch is missing")
    finished = {job.id: (job.id, job.finished_at) for job in found.values() if job.state in FINISHED_JOB_STATES}
    made: dict[str, ZooRow | None] = {}
    for job_id, name in finished.items():
        cached = rows.get(name) if rows is not None else None
        if cached is not None:
            made[job_id] = cached
    missing = [job_id for job_id in finished if job_id not in made]
    if missing:
        results = dict(session.execute(select(JobRow.id, JobRow.result).where(JobRow.id.in_(missing))).all())
        for job_id in missing:
            job = found[job_id].to_dict()
            made[job_id] = ZooRow.from_job({**job, "result": results.get(job_id)})
            if rows is not None and made[job_id] is not None:
                rows.put(finished[job_id], made[job_id])
    return ZooBatch(id=row.id, zoo=row.zoo, filter=row.filter, request=row.request, created_at=row.created_at,
                    models=tuple(e.model for e in row.jobs), jobs=tuple(found[job_id] for job_id in ids), rows=made)


@dataclass(frozen=True, kw_only=True)
class ZooBatchSummary:
    """A zoo batch at a glance: what was asked and how many of its jobs are in each state."""

    id: str
    zoo: str
    filter: str | None
    request: Mapping[str, Any]
    created_at: datetime
    counts: Mapping[str, int]
    """Jobs per state (every ``JobState``, zero included)."""

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def finished(self) -> int:
        return sum(self.counts[state] for state in FINISHED_JOB_STATES)

    @property
    def done(self) -> bool:
        return self.finished == self.total


def recent_batches(*, session: Session, limit: int = 50, offset: int = 0) -> tuple[list[ZooBatchSummary], bool]:
    """A page of zoo batches, newest first, and whether more follow: two bounded reads (the page, walked in
    ``ix_zoo_batches_created_at`` order to one row past it, and its jobs' states counted per batch)."""
    rows = list(session.execute(select(ZooBatchRow).order_by(ZooBatchRow.created_at.desc(), ZooBatchRow.id)
                                .limit(limit + 1).offset(offset)).scalars())
    page = rows[:limit]
    counts = {row.id: dict.fromkeys((state.value for state in JobState), 0) for row in page}
    if page:
        for batch_id, state, n in session.execute(
                select(ZooBatchJobRow.batch_id, JobRow.state, func.count())
                .join(JobRow, ZooBatchJobRow.job_id == JobRow.id)
                .where(ZooBatchJobRow.batch_id.in_(counts)).group_by(ZooBatchJobRow.batch_id, JobRow.state)):
            counts[batch_id][state] = n
    return [ZooBatchSummary(id=row.id, zoo=row.zoo, filter=row.filter, request=row.request,
                            created_at=row.created_at, counts=counts[row.id]) for row in page], len(rows) > limit
