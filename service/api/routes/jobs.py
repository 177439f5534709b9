"""``POST /v1/jobs`` (record and enqueue a profiling job), ``GET /v1/jobs/{id}`` and ``GET /v1/jobs``."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, HTTPException, Path, Query, status
from fastapi.responses import JSONResponse

from remat.service import jobs
from remat.service.api.deps import (
    OPTIONAL_AUTH,
    READ_RESPONSES,
    WRITE_RESPONSES,
    StateDep,
    require_reader,
    require_writer,
)
from remat.service.schemas import ErrorOut, JobCreate, JobOut, JobsPage

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

JobId = Annotated[str, Path(pattern=r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
                            description="Job id (a UUID) as returned by POST /v1/jobs.")]


@router.post("", status_code=status.HTTP_202_ACCEPTED, response_model=JobOut, responses=WRITE_RESPONSES,
             dependencies=[Depends(require_writer)])
def create_job(body: JobCreate, state: StateDep) -> JSONResponse:
    """Record a profiling job, then hand its id to the workers (``worker.profile_model``).

    The job is committed before it is enqueued, so a worker never looks for a job that is not there yet.
    If the broker cannot be reached the job is still recorded, as ``failed`` with an error that says so,
    and the answer is still 202: poll ``GET /v1/jobs/{id}`` either way.
    """
    with state.db.write_session() as session:
        job, _ = jobs.create_job(session=session, request=body.model_dump())
    error = state.queue.enqueue_profile(job.id)
    with state.db.write_session() as session:
        # Conditional: a fast worker may already have moved the job to "running".
        updated = jobs.update_job(session=session, job_id=job.id, only_from=("pending",),
                                        state="failed" if error else "queued",
                                        error=f"enqueue: {error}" if error else None)
    return JSONResponse(status_code=status.HTTP_202_ACCEPTED, content=(updated or job).to_dict())


@router.get("/{job_id}", response_model=JobOut,
            responses={404: {"model": ErrorOut, "description": "No such job."}, **READ_RESPONSES},
            dependencies=[Depends(require_reader)], openapi_extra=OPTIONAL_AUTH)
def read_job(job_id: JobId, state: StateDep) -> JSONResponse:
    """A job's state, progress, error and (when finished) result."""
    with state.db.read_session() as session:
        job = jobs.get_job(session=session, job_id=job_id)
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"job_id: no job {job_id}")
    return JSONResponse(content=job.to_dict())


@router.get("", response_model=JobsPage, responses=READ_RESPONSES, dependencies=[Depends(require_reader)],
            openapi_extra=OPTIONAL_AUTH)
def list_jobs(
    state: StateDep,
    state_filter: Annotated[Literal["pending", "queued", "running", "succeeded", "failed"] | None,
                            Query(alias="state")] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> JSONResponse:
    """Jobs, newest first, optionally in one state."""
    with state.db.read_session() as session:
        page, total = jobs.list_jobs(session=session, state=state_filter, limit=limit, offset=offset)
    return JSONResponse(content={"data": [j.to_dict() for j in page], "count": total})
