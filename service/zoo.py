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

from sqlalchemy.orm import Session

from remat.client.job_state import FINISHED_JOB_STATES, JobState
from remat.client.request import ModelRequest
from remat.client.zoo_batch import ZooRow
from remat.service import jobs
from remat.service.models import ZooBatchJobRow, ZooBatchRow, utcnow
from remat.service.records import JobRecord

__all__ = ["ZooBatch", "create_batch", "get_batch", "job_request_key"]


def job_request_key(request: ModelRequest, *, refresh: bool) -> str:
    """The dedup key of a model's job: equal requests share one run; a refresh is its own run."""
    if not refresh:
        return request.fingerprint
    return hashlib.sha256(f"{request.fingerprint}:refresh".encode()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class ZooBatch:
    """A zoo batch with its jobs, in the order of the selection."""

    id: str
    zoo: str
    filter: str | None
    request: Mapping[str, Any]
    created_at: datetime
    models: tuple[str, ...]
    jobs: tuple[JobRecord, ...]

    def to_dict(self) -> dict[str, Any]:
        """``GET /v1/zoo/{id}``: counts per state, overall progress and a row per model once it finished."""
        counts = dict.fromkeys((state.value for state in JobState), 0)
        entries = []
        for model, job in zip(self.models, self.jobs, strict=True):
            counts[job.state] += 1
            row = ZooRow.from_job(job.to_dict()) if job.state in FINISHED_JOB_STATES else None
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


def get_batch(*, session: Session, batch_id: str) -> ZooBatch | None:
    row = session.get(ZooBatchRow, batch_id)
    if row is None:
        return None
    records = [jobs.get_job(session=session, job_id=entry.job_id) for entry in row.jobs]
    if any(r is None for r in records):  # the foreign keys make this impossible; say so if it ever happens
        raise RuntimeError(f"zoo batch {batch_id}: a job of the batch is missing")
    return ZooBatch(id=row.id, zoo=row.zoo, filter=row.filter, request=row.request, created_at=row.created_at,
                    models=tuple(e.model for e in row.jobs), jobs=tuple(r for r in records if r is not None))
