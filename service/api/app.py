"""The FastAPI application: routers, error handlers, the body size limit, and the shared state.

``create_app(settings)`` builds everything eagerly (database engine, migrations when
``REMAT_AUTO_MIGRATE``, cache client, broker client) so that a misconfigured server fails at start-up and
an in-process client (tests, schemathesis) needs no lifespan events.

Errors leave as ``{"detail": "<field>: <what is wrong>"}``: request validation errors are flattened to
one line naming the field, trace and key errors keep the message of the library that raised them, and a
database that cannot be reached is a 503, not a 500.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.routing import APIRoute
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from remat.client import wire_json
from remat.client.errors import PlanError, TraceFormatError
from remat.client.zoo_batch import ZooRow
from remat.service import migrate
from remat.service.api.deps import ServiceState
from remat.service.api.limits import BodySizeLimitMiddleware
from remat.service.api.routes import health, jobs, measurements, plans, traces, ui, zoo
from remat.service.cache import PlanCache
from remat.service.celery_client import JobQueue
from remat.service.config import ServiceSettings, redact_url
from remat.service.db import Database
from remat.service.errors import InvalidKeyError
from remat.service.lru import LruCache
from remat.service.ui.links import UI_PREFIX
from remat.service.ui.pages import SECURITY_HEADERS, render_error
from remat.service.ui.pictures import PictureCache

log = logging.getLogger(__name__)

ZOO_ROWS_KEPT = 4096
"""Finished zoo jobs whose rows the web pages keep (a batch has at most 500 models)."""


def _operation_id(route: APIRoute) -> str:
    """Stable OpenAPI operation ids (``plans-read_plan``) so generated clients keep their method names."""
    return f"{route.tags[0]}-{route.name}" if route.tags else route.name


def _field(loc: Sequence[Any]) -> str:
    parts = [p for p in loc if p not in ("body", "query", "path", "header")] or list(loc[-1:])
    return wire_json.place([p if isinstance(p, int) else str(p) for p in parts]) or "body"


def _validation_message(exc: RequestValidationError) -> str:
    errors = exc.errors()
    if not errors:
        return "request: invalid"
    first = errors[0]  # (JSON that does not parse never gets here: service_route refuses it, naming the place)
    msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    field = _field(first.get("loc", ()))
    if msg.startswith(f"{field}:") or (": " in msg and msg.split(": ", 1)[0].isidentifier()):
        return msg  # a model validator that already names its field
    return f"{field}: {msg}"


def _is_page(request: Request) -> bool:
    """A web page's request (``/ui/...``): its errors are pages too, not JSON."""
    path = request.url.path
    return path == UI_PREFIX or path.startswith(UI_PREFIX + "/")


def _error_page(status: int, detail: str, headers: Mapping[str, str] | None = None) -> HTMLResponse:
    return HTMLResponse(render_error(status, detail), status_code=status,
                        headers={**SECURITY_HEADERS, **(headers or {})})


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    if _is_page(request):
        return _error_page(422, _validation_message(exc))
    return JSONResponse(status_code=422, content={"detail": _validation_message(exc)})


_FASTAPI_BODY_ERROR = "There was an error parsing the body"


async def _on_http_error(request: Request, exc: Exception) -> Response:
    """Name the field in FastAPI's own messages, and list every method of a path in a 405's ``Allow``."""
    assert isinstance(exc, StarletteHTTPException)
    if _is_page(request):
        detail = exc.detail if exc.status_code != 404 or exc.detail != "Not Found" else \
            f"path: no page at {request.url.path}"
        return _error_page(exc.status_code, str(detail), exc.headers)
    if exc.status_code == 400 and exc.detail == _FASTAPI_BODY_ERROR:
        return JSONResponse(status_code=400, content={"detail": "body: cannot be decoded as UTF-8 JSON"})
    if exc.status_code == 405:
        # Starlette answers with the methods of the first route that matched the path only; the routes are
        # those the routers declared (FastAPI wraps included routers, so the app's own list holds none).
        methods = sorted({m for route in request.app.state.api_routes
                          if route.matches(request.scope)[0] != Match.NONE for m in route.methods})
        if not methods:  # not one of ours (/docs): Starlette's answer is complete
            return await http_exception_handler(request, exc)
        return JSONResponse(status_code=405, headers={"Allow": ", ".join(methods)},
                            content={"detail": f"method: {request.method} is not allowed on {request.url.path}; "
                                               f"use {', '.join(methods)}"})
    return await http_exception_handler(request, exc)


async def _on_bad_input(_request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(status_code=422, content={"detail": str(exc)})


async def _on_database_down(request: Request, exc: Exception) -> Response:
    log.warning("remat service: database unavailable: %s", exc)
    detail = f"database: unavailable ({type(exc).__name__})"
    if _is_page(request):
        return _error_page(503, detail, {"Retry-After": "5"})
    return JSONResponse(status_code=503, headers={"Retry-After": "5"}, content={"detail": detail})


def build_state(settings: ServiceSettings) -> ServiceState:
    """Open the database (migrating it when configured to), the cache and the broker client."""
    db = Database(settings.database_url)
    try:
        if settings.auto_migrate:
            if migrate.ensure_current(db):
                log.info("remat service: migrated %s to %s", redact_url(db.url), migrate.head_revision())
    except BaseException:
        db.dispose()
        raise
    return ServiceState(settings=settings, db=db, cache=PlanCache(settings), queue=JobQueue(settings))


def _load_zoo_names(serving: threading.Event) -> None:
    from remat.client.zoo import available_models

    try:
        available_models()
    except Exception:  # noqa: BLE001 - a failure here shows up, with its reason, at the first submission
        log.warning("could not load the model zoo's names", exc_info=True)
    # NOTE [frozen start-up objects]: torchvision brought torch's millions of objects, which live as long as
    # the process. Left to the collector, every full collection walks them all: a pause of about 250 ms every
    # few hundred requests that allocate (docs/benchmarks.md, "Web pages"). Frozen, collections skip them
    # while the app serves; they are unfrozen when it stops, so that the interpreter's last collection frees
    # what it should (an app in a test process stops long before the process ends).
    if serving.is_set():
        gc.freeze()


def create_app(settings: ServiceSettings | None = None) -> FastAPI:
    """The ASGI app; ``settings`` default to the environment (``REMAT_*``)."""
    settings = settings or ServiceSettings()
    state = build_state(settings)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # POST /v1/jobs checks zoo names against torchvision, whose import takes seconds: start it now, off the
        # event loop, so that the first submission does not pay for it.
        serving = threading.Event()
        serving.set()
        threading.Thread(target=_load_zoo_names, args=(serving,), name="zoo-names", daemon=True).start()
        yield
        serving.clear()
        gc.unfreeze()
        state.close()

    app = FastAPI(
        title="remat plan service",
        version="1",
        summary="Measured activation-checkpointing plans, stored by architecture hash.",
        generate_unique_id_function=_operation_id,
        lifespan=lifespan,
    )
    app.state.remat = state
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    for bad_input in (TraceFormatError, InvalidKeyError, PlanError):
        app.add_exception_handler(bad_input, _on_bad_input)
    for db_down in (OperationalError, InterfaceError, PoolTimeoutError):
        app.add_exception_handler(db_down, _on_database_down)
    routers = [module.router for module in (health, traces, plans, measurements, jobs, zoo, ui)]
    app.include_router(ui.front)
    for router in routers:
        app.include_router(router)
    app.state.ui_pictures = PictureCache()
    app.state.ui_zoo_rows = LruCache[ZooRow | None](ZOO_ROWS_KEPT)
    app.state.api_routes = [route for router in routers for route in router.routes if isinstance(route, APIRoute)]
    return app
