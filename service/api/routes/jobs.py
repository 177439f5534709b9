"""``POST /v1/jobs`` (record, deduplicate and enqueue a profiling job), ``GET /v1/jobs/{id}``, ``GET /v1/jobs``."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path, Query, status
from fastapi.responses import JSONResponse

from remat.client.devices import queue_device
from remat.client.errors import ModelError, UnknownModelError
from remat.client.request import ModelRequest
from remat.service import jobs
from remat.service.api.deps import (
    OPTIONAL_AUTH,
    READ_RESPONSES,
    WRITE_RESPONSES,
    ServiceState,
    StateDep,
    require_reader,
    require_writer,
)
from remat.service.api.service_route import ServiceRoute
from remat.service.celery_client import send_job
from remat.service.records import JobRecord
from remat.service.schemas import ErrorOut, JobCreate, JobOut, JobsPage, JobStateName

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], route_class=ServiceRoute)

JobId = Annotated[str, Path(pattern=r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
                            description="Job id (a UUID) as returned by POST /v1/jobs.")]


def _model_request(body: JobCreate) -> ModelRequest:
    """The request in its canonical form; an unknown model name is refused here, not by a worker later."""
    if body.model.startswith("hf:"):
        return _hf_request(body)
    if body.model_kwargs:
        raise HTTPException(422, detail="model_kwargs: a service's workers build torchvision models with their "
                                        "default arguments; only hf: models take model_kwargs (configuration fields)")
    if body.seq_len is not None:
        raise HTTPException(422, detail=f"seq_len: {body.model} takes images; seq_len applies to hf: token models")
    from remat.client.zoo import canonical_name  # imports torchvision, once per process

    try:
        canonical_name(body.model)
    except UnknownModelError as exc:
        raise HTTPException(422, detail=f"model: {exc}") from None
    _check_fixed_size(body)
    return ModelRequest.from_dict(body.model_dump(exclude={"queue"}))  # PlanError (422) names the field


def _check_fixed_size(body: JobCreate) -> None:
    """A model built for one image size (torchvision's ViT and MaxViT) at another is refused here, in the API's
    words: the worker would refuse it minutes later in the CLI's (``--input-shape``, ``--model-kwargs``), and a
    service builds torchvision models with their default arguments, so the size is the only thing to change."""
    from remat.client.model_spec import canonical_spec, fixed_sample_shape

    fixed = fixed_sample_shape(body.model)
    if fixed is not None and tuple(body.input_shape) != fixed:
        raise HTTPException(422, detail=f"input_shape: {canonical_spec(body.model)} is built for {list(fixed)} "
                                        f"images only (a service builds torchvision models with their default "
                                        f"arguments), got {body.input_shape}")


def _hf_request(body: JobCreate) -> ModelRequest:
    """An ``hf:NAME`` request: an allow-list name (never a path), configuration fields it has, and the input
    its kind takes (``[seq_len]`` for token models, the configuration's image size for vision models). Checking
    the fields imports transformers (and so torch), once per process, when there are any."""
    from remat.client.hf_models import (
        check_override_values,
        check_service_spec,
        check_two_tower_input,
        hf_image_shape,
        input_kind,
    )
    from remat.client.model_spec import canonical_spec

    try:
        check_service_spec(body.model, body.model_kwargs)
        spec = canonical_spec(body.model)
        kwargs = check_override_values(body.model_kwargs)
        seq_len = body.seq_len
        if input_kind(spec) != "image":
            if len(body.input_shape) != 1:
                raise HTTPException(422, detail=f"input_shape: {spec} takes token ids: input_shape is [seq_len], "
                                                f"got {body.input_shape}")
            seq_len = body.input_shape[0] if seq_len is None else seq_len
            check_two_tower_input(spec, kwargs, seq_len, field="seq_len")
        else:
            if seq_len is not None:
                raise HTTPException(422, detail=f"seq_len: {spec} takes images, not token sequences")
            shape = list(hf_image_shape(spec, kwargs))
            if body.input_shape != shape:
                raise HTTPException(422, detail=f"input_shape: {spec} trains at its configuration's image size "
                                                f"{shape}; set image_size in model_kwargs, got {body.input_shape}")
    except ModelError as exc:
        raise HTTPException(422, detail=str(exc)) from None
    # PlanError (422) names the field: a seq_len that is not the input_shape's.
    return ModelRequest.from_dict({**body.model_dump(exclude={"queue"}), "model": spec, "model_kwargs": kwargs,
                                   "seq_len": seq_len})


def _submit(body: JobCreate, state: ServiceState) -> JobRecord:
    request = _model_request(body)
    queue = body.queue or request.device
    if queue_device(queue) != request.device:
        raise HTTPException(422,
                            detail=f"queue: {queue!r} is not a queue of device {request.device!r}")
    with state.db.write_session() as session:
        job, must_enqueue = jobs.create_job(session=session, request=request.to_dict(), kind="profile",
                                            request_key=request.fingerprint, queue=queue)
    return send_job(state.db, state.queue, job) if must_enqueue else job


@router.post("", status_code=status.HTTP_202_ACCEPTED, response_model=JobOut, responses=WRITE_RESPONSES,
             dependencies=[Depends(require_writer)])
def create_job(body: JobCreate, state: StateDep) -> JSONResponse:
    """Record a profiling job, then hand its id to the workers of its queue (``worker.profile_model``).

    - The job is committed before it is enqueued, so a worker never looks for a job that is not there yet.
    - A request identical (in canonical form) to one already pending, queued or running is not run twice: the
      new job *follows* that one (``leader_id``) and ends with its result.
    - If the broker cannot be reached the job stays ``pending`` and a worker's reaper sends it once the broker
      is back; the answer is 202 either way: poll ``GET /v1/jobs/{id}``.
    - An unknown model or a malformed request is 422 naming the field, and nothing is recorded.
    """
    return JSONResponse(status_code=status.HTTP_202_ACCEPTED, content=_submit(body, state).to_dict())


@router.get("/{job_id}", response_model=JobOut,
            responses={404: {"model": ErrorOut, "description": "No such job."}, **READ_RESPONSES},
            dependencies=[Depends(require_reader)], openapi_extra=OPTIONAL_AUTH)
def read_job(job_id: JobId, state: StateDep) -> JSONResponse:
    """A job's state, progress (``message`` names the phase), plan key, error and, when finished, its result."""
    with state.db.read_session() as session:
        job = jobs.get_job(session=session, job_id=job_id)
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"job_id: no job {job_id}")
    return JSONResponse(content=job.to_dict())


@router.get("", response_model=JobsPage, responses=READ_RESPONSES, dependencies=[Depends(require_reader)],
            openapi_extra=OPTIONAL_AUTH)
def list_jobs(
    state: StateDep,
    state_filter: Annotated[JobStateName | None, Query(alias="state")] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> JSONResponse:
    """Jobs, newest first, optionally in one state."""
    with state.db.read_session() as session:
        page, total = jobs.list_jobs(session=session, state=state_filter, limit=limit, offset=offset)
    return JSONResponse(content={"data": [j.to_dict() for j in page], "count": total})
