"""``POST /v1/traces``: store a trace, plan it with every algorithm, store and return the plans."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, status
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from remat.client.errors import TraceFormatError
from remat.client.trace import Trace, loads_trace
from remat.service import repository
from remat.service.api.deps import WRITE_RESPONSES, ServiceState, StateDep, require_writer
from remat.service.keys import check_storable, trace_key
from remat.service.schemas import TRACE_REQUEST_BODY, TraceStoredOut

router = APIRouter(prefix="/v1/traces", tags=["traces"])


def _parse(body: bytes) -> Trace:
    """Parse and bound-check an upload; every failure is a TraceFormatError naming the field."""
    try:
        trace = loads_trace(body)
    except RecursionError:
        raise TraceFormatError("trace: JSON nested too deeply") from None
    check_storable(trace)
    trace_key(trace)  # key metadata errors before the planners run, not after
    return trace


def _store(state: ServiceState, body: bytes) -> JSONResponse:
    # planners are pure Python, but only this route needs them
    from remat.worker.planning import STORED_COST_MODEL, plan_all

    trace = _parse(body)
    plans = plan_all(trace, cost_model=STORED_COST_MODEL)
    with state.db.write_session() as session:
        stored = repository.store_trace(session=session, trace=trace)
        repository.store_plans(session=session, trace_id=stored.trace_id, plans=plans)
    state.cache.delete_plans(stored.key, [(p.algorithm, p.budget_bytes) for p in plans])
    content = {"key": stored.key.to_dict(), "trace_id": stored.trace_id, "content_sha256": stored.content_sha256,
               "created": stored.created, "plans": [p.to_dict() for p in plans]}
    return JSONResponse(status_code=status.HTTP_201_CREATED if stored.created else status.HTTP_200_OK,
                        content=content)


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=TraceStoredOut,
    responses={200: {"model": TraceStoredOut, "description": "The same trace was stored before."},
               **WRITE_RESPONSES},
    dependencies=[Depends(require_writer)],
    openapi_extra=TRACE_REQUEST_BODY,
)
async def create_trace(request: Request, state: StateDep) -> JSONResponse:
    """Store a ``remat-trace/1`` trace and the plans of every registered algorithm computed from it.

    Idempotent: the same trace content is stored once (200 instead of 201), and its plans replace those
    stored under the same key, algorithm and budget.
    """
    body = await request.body()
    return await run_in_threadpool(_store, state, body)
