"""``POST /v1/zoo`` (a profiling job per model of a zoo, in one batch) and ``GET /v1/zoo/{id}`` (its progress
and a summary row per finished model)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path, status
from fastapi.responses import JSONResponse

from remat.client.devices import queue_device
from remat.client.errors import ModelError, PlanError, UnknownModelError
from remat.client.request import ModelRequest
from remat.service import zoo
from remat.service.api.deps import (
    OPTIONAL_AUTH,
    READ_RESPONSES,
    WRITE_RESPONSES,
    StateDep,
    require_reader,
    require_writer,
)
from remat.service.api.service_route import ServiceRoute
from remat.service.celery_client import send_job
from remat.service.schemas import ErrorOut, ZooCreate, ZooOut

router = APIRouter(prefix="/v1/zoo", tags=["zoo"], route_class=ServiceRoute)

MAX_ZOO_MODELS = 500
"""Jobs one batch may create (torchvision's classification registry has 80 models)."""

BatchId = Annotated[str, Path(pattern=r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
                              description="Batch id (a UUID) as returned by POST /v1/zoo.")]


def _requests(body: ZooCreate) -> list[ModelRequest]:
    """One request per selected model; a filter matching nothing, or a size some model cannot take, is 422."""
    from remat.client.zoo_batch import select_zoo_models, zoo_requests  # torchvision: preloaded at startup

    try:
        models = select_zoo_models(body.zoo, body.filter)
    except UnknownModelError as exc:
        raise HTTPException(422, detail=str(exc)) from None
    if len(models) > MAX_ZOO_MODELS:
        raise HTTPException(422, detail=f"filter: selects {len(models)} models, more than the {MAX_ZOO_MODELS} "
                                        f"one batch may run")
    try:  # an hf zoo model's configuration fields are checked against transformers' configuration
        return zoo_requests(models, batch_size=body.batch_size,
                            sample_shape=tuple(body.input_shape) if body.input_shape else None,
                            seq_len=body.seq_len, device=body.device, grads=body.grads, dtype=body.dtype)
    except (PlanError, ModelError) as exc:
        raise HTTPException(422, detail=str(exc)) from None


@router.post("", status_code=status.HTTP_202_ACCEPTED, response_model=ZooOut, responses=WRITE_RESPONSES,
             dependencies=[Depends(require_writer)])
def create_zoo(body: ZooCreate, state: StateDep) -> JSONResponse:
    """Record a zoo batch and a profiling job for each model its filter selects, then send the jobs.

    Each job is an ordinary profiling job (``GET /v1/jobs/{id}`` works on it): a model whose request is
    already running follows that run, and a model whose plans are stored ends at once with them unless
    ``refresh`` is set. Everything is recorded in one transaction before any job is sent.
    """
    requests = _requests(body)
    queue = body.queue or body.device
    if queue_device(queue) != body.device:
        raise HTTPException(422, detail=f"queue: {queue!r} is not a queue of device {body.device!r}")
    template = body.model_dump(exclude={"zoo", "filter"})
    with state.db.write_session() as session:
        batch, to_send = zoo.create_batch(session=session, zoo=body.zoo, filter=body.filter, template=template,
                                          requests=requests, queue=queue, refresh=body.refresh)
    for job in to_send:
        send_job(state.db, state.queue, job)
    with state.db.read_session() as session:
        batch = zoo.get_batch(session=session, batch_id=batch.id) or batch
    return JSONResponse(status_code=status.HTTP_202_ACCEPTED, content=batch.to_dict())


@router.get("/{batch_id}", response_model=ZooOut,
            responses={404: {"model": ErrorOut, "description": "No such batch."}, **READ_RESPONSES},
            dependencies=[Depends(require_reader)], openapi_extra=OPTIONAL_AUTH)
def read_zoo(batch_id: BatchId, state: StateDep) -> JSONResponse:
    """A zoo batch: counts per job state, overall progress, and per model its job and, once finished, its row
    (stages, peaks without checkpointing and with ``linear``, saving, step-time overhead, prediction error)
    or the reason it failed."""
    with state.db.read_session() as session:
        batch = zoo.get_batch(session=session, batch_id=batch_id)
    if batch is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"batch_id: no zoo batch {batch_id}")
    return JSONResponse(content=batch.to_dict())
