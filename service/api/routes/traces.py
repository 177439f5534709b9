"""``POST /v1/traces``: store a trace, plan it with every algorithm, store and return the plans."""

from __future__ import annotations

import hashlib

from fastapi import APIRouter, Depends, Request, status
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from remat.client.trace import Trace, loads_trace
from remat.service import jobs, repository
from remat.service.api.deps import WRITE_RESPONSES, ServiceState, StateDep, require_writer
from remat.service.api.service_route import ServiceRoute
from remat.service.celery_client import PLAN_QUEUE, send_job
from remat.service.config import ServiceSettings
from remat.service.errors import TraceRejectedError
from remat.service.keys import check_storable, trace_key
from remat.service.plan_limits import split_algorithms
from remat.service.schemas import TRACE_REQUEST_BODY, TraceStoredOut

router = APIRouter(prefix="/v1/traces", tags=["traces"], route_class=ServiceRoute)


def _parse(body: bytes, settings: ServiceSettings) -> Trace:
    """Parse and bound-check an upload; every failure is a TraceFormatError naming the field."""
    trace = loads_trace(body)  # wire_json: bounded nesting, finite numbers
    if trace.num_stages > settings.max_stages:
        raise TraceRejectedError(f"stages: {trace.num_stages} stages, more than the {settings.max_stages} this "
                                 f"service plans (REMAT_MAX_STAGES); merge stages, e.g. cut at block boundaries")
    if trace.graph is not None and trace.graph.num_vertices > settings.max_graph_vertices:
        raise TraceRejectedError(f"graph.vertices: {trace.graph.num_vertices} vertices, more than the "
                                 f"{settings.max_graph_vertices} this service plans (REMAT_MAX_GRAPH_VERTICES); "
                                 "leave the graph out to plan the chain")
    check_storable(trace)
    trace_key(trace)  # key metadata errors before the planners run, not after
    return trace


def _store(state: ServiceState, body: bytes) -> JSONResponse:
    # planners are pure Python, but only this route needs them
    from remat.client.plan import BUDGET_ALGORITHM
    from remat.client.planning.plans import plans_to_store

    trace = _parse(body, state.settings)
    inline, deferred, skipped = split_algorithms(trace.num_stages, state.settings)
    plans = plans_to_store(trace, algorithms=[a for a in inline if a != BUDGET_ALGORITHM],
                           frontier=BUDGET_ALGORITHM in inline)
    job = None
    must_enqueue = False
    with state.db.write_session() as session:
        stored = repository.store_trace(session=session, trace=trace)
        written = repository.store_plans(session=session, trace_id=stored.trace_id, plans=plans)
        superseded_by = written.superseded_by if written is not None else None
        if deferred and superseded_by is None \
                and not repository.has_plans(session=session, trace_id=stored.trace_id, algorithms=deferred):
            job, must_enqueue = jobs.create_job(
                session=session, kind="plan", queue=PLAN_QUEUE,
                request={"trace_id": stored.trace_id, "algorithms": deferred},
                request_key=hashlib.sha256(f"plan:{stored.content_sha256}:{','.join(deferred)}".encode()).hexdigest())
    state.cache.delete_plans(stored.key, [(p.algorithm, p.budget_bytes) for p in plans])
    if job is not None and must_enqueue:
        job = send_job(state.db, state.queue, job)
    content = {"key": stored.key.to_dict(), "trace_id": stored.trace_id, "content_sha256": stored.content_sha256,
               "created": stored.created, "superseded_by": superseded_by,
               "plans": [p.to_dict() for p in plans if not p.budget_bytes],
               "frontier": [p.to_dict() for p in plans if p.budget_bytes],
               "deferred": [{"algorithm": a, "job_id": job.id if job else None} for a in deferred],
               "skipped": [{"algorithm": a, "reason": why} for a, why in skipped.items()]}
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

    Bounded (docs/service.md, "Limits"): a trace above ``REMAT_MAX_STAGES`` stages is 422; ``cubic`` runs
    inline up to ``REMAT_INLINE_CUBIC_STAGES`` stages, as a job on the ``plan`` queue up to
    ``REMAT_MAX_CUBIC_STAGES`` (``deferred`` names the job; its plan appears under the same key when done), and
    is ``skipped`` beyond. Idempotent: the same trace content is stored once (200 instead of 201), and its plans
    replace those stored under the same key, algorithm and budget — unless a newer trace of the key is stored
    (an older content uploaded again): then the key keeps the newer plans and ``superseded_by`` names that trace.
    """
    body = await request.body()
    return await run_in_threadpool(_store, state, body)
