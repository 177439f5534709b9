"""``POST /v1/measurements``: attach a validation run (measured peak, step time, gradient check) to a plan."""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, status
from fastapi.responses import JSONResponse

from remat.client.measurement import STORED_FIELDS, Measurement
from remat.service import repository
from remat.service.api.deps import WRITE_RESPONSES, StateDep, require_writer
from remat.service.api.service_route import ServiceRoute
from remat.service.schemas import ErrorOut, MeasurementCreate, MeasurementOut

router = APIRouter(prefix="/v1/measurements", tags=["measurements"], route_class=ServiceRoute)


@router.post("", status_code=status.HTTP_201_CREATED, response_model=MeasurementOut,
             responses={404: {"model": ErrorOut, "description": "No such plan is stored."}, **WRITE_RESPONSES},
             dependencies=[Depends(require_writer)])
def create_measurement(body: MeasurementCreate, state: StateDep) -> JSONResponse:
    """Record what a real training step with the plan measured; the plan's cached reads are invalidated."""
    key = body.key.to_key()
    fields = body.model_dump(include=set(STORED_FIELDS))
    for name in ("checkpoints", "dropped_vertices"):
        fields[name] = tuple(getattr(body, name)) if getattr(body, name) is not None else None
    measurement = Measurement(algorithm=body.algorithm, **fields)
    with state.db.write_session() as session:
        stored = repository.store_measurement(session=session, key=key, algorithm=body.algorithm,
                                              budget_bytes=body.budget_bytes, measurement=measurement)
    if stored is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND,
                            detail=f"key: no {body.algorithm} plan is stored for {key.model_hash} with "
                                   f"input_shape {key.input_shape_text or '()'}, "
                                   f"{key.describe(exclude=('model_hash', 'input_shape'))}")
    state.cache.delete_plans(key, [(body.algorithm, body.budget_bytes)])
    return JSONResponse(status_code=status.HTTP_201_CREATED, content=stored.to_dict())
