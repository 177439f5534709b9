"""``GET /healthz``: can the service reach its database, its cache and its broker?"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError

from remat.service import repository
from remat.service.api.deps import StateDep
from remat.service.api.service_route import ServiceRoute
from remat.service.schemas import HealthOut

router = APIRouter(tags=["health"], route_class=ServiceRoute)


@router.get("/healthz", response_model=HealthOut, responses={503: {"model": HealthOut}})
def read_health(state: StateDep) -> JSONResponse:
    """Database, cache and broker reachability; 503 only when the database is down (a dead cache only slows
    reads, a dead broker only delays new jobs)."""
    try:
        with state.db.read_session() as session:
            repository.ping(session=session)
        database = {"ok": True, "detail": None}
    except SQLAlchemyError as exc:
        database = {"ok": False, "detail": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    if state.cache.enabled:
        error = state.cache.ping()
        cache = {"ok": error is None, "detail": error}
    else:
        cache = {"ok": True, "detail": "disabled"}
    broker_error = state.queue.ping()
    broker = {"ok": broker_error is None, "detail": broker_error}
    status = "unavailable" if not database["ok"] else "ok" if cache["ok"] and broker["ok"] else "degraded"
    body = HealthOut.model_validate({"status": status, "database": database, "cache": cache, "broker": broker})
    return JSONResponse(status_code=503 if status == "unavailable" else 200, content=body.model_dump())
