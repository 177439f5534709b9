"""The web pages (``/ui/...``) and the service's front page (``/``): read-only HTML over the plan database.

Every page is a GET that renders on the server (``remat.service.ui.pages``) from the repository's bounded reads:
a page of at most ``PAGE_SIZE`` rows, a key's plans, a page of a trace's stages. Tables are plain HTML and work
without script; pages of running work reload themselves (``<meta http-equiv="refresh">``) until it ends. The two
pictures of a key are SVG documents of their own, drawn once per version of the key's rows
(``repository.key_version``) and answered 304 while the browser's copy is current. Reads follow the JSON
routes' rule (``require_page_reader``: the same tokens, also as an HTTP Basic password a browser can send).
None of these routes is in the OpenAPI schema: they are pages, not the API.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Hashable
from importlib import resources
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request, status
from fastapi.responses import HTMLResponse, Response
from sqlalchemy.orm import Session

from remat.client.errors import RematError
from remat.client.job_state import JobState
from remat.client.plan_key import PlanKey
from remat.client.planning.planners import DEFAULT_PLANNER, PLANNERS
from remat.client.report import BASELINE_ALGORITHM
from remat.service import jobs, repository, zoo
from remat.service.api.deps import StateDep, require_page_reader
from remat.service.api.routes.jobs import JobId
from remat.service.api.routes.plans import KeyDep
from remat.service.api.routes.zoo import BatchId
from remat.service.api.service_route import ServiceRoute
from remat.service.ui import views
from remat.service.ui.fetch_lines import fetch_lines
from remat.service.ui.pages import PAGE_SIZE, SECURITY_HEADERS, render
from remat.service.ui.pictures import PictureCache, frontier_picture, timeline_picture

router = APIRouter(prefix="/ui", tags=["ui"], route_class=ServiceRoute, include_in_schema=False,
                   dependencies=[Depends(require_page_reader)])
front = APIRouter(tags=["ui"], route_class=ServiceRoute, include_in_schema=False)

Planner = Literal[tuple(PLANNERS)]  # type: ignore[valid-type]  # the registry is the one list
REFRESH_S = 2
"""Seconds between reloads of a page that shows running work."""
MAX_PAGE = 20_000
"""The last page a table may be asked for (an offset of a million rows)."""
STAGE_PAGE_SIZE = 200
"""Stages of a trace shown per page of a key's page (a trace may have 20,000)."""
Page = Annotated[int, Query(ge=1, le=MAX_PAGE, description="Page of the table, from 1.")]
STATIC = {name: resources.files("remat.service.ui").joinpath("static", name).read_bytes()
          for name in ("ui.css", "favicon.svg")}
STATIC_TYPES = {"ui.css": "text/css; charset=utf-8", "favicon.svg": "image/svg+xml"}
PICTURE_HEADERS = {"Content-Security-Policy": "default-src 'none'", "X-Content-Type-Options": "nosniff",
                   "Cache-Control": "private, no-cache"}


def _page(template: str, **context: Any) -> HTMLResponse:
    return HTMLResponse(render(template, **context), headers=SECURITY_HEADERS)


def _etag(name: Hashable) -> str:
    return '"' + hashlib.sha256(repr(name).encode("utf-8")).hexdigest()[:32] + '"'


STATIC_ETAGS = {name: _etag(content) for name, content in STATIC.items()}


def _not_modified(request: Request, etag: str) -> bool:
    return etag in [t.strip() for t in request.headers.get("if-none-match", "").split(",")]


@front.get("/")
def front_page() -> HTMLResponse:
    """Where a browser pointed at the service lands: the web pages, the API's documentation, its health."""
    return _page("index.html")


@router.get("/static/{name}")
def static_file(name: Literal["ui.css", "favicon.svg"], request: Request) -> Response:
    """The stylesheet and the icon, shipped in the package (nothing is fetched from elsewhere)."""
    etag = STATIC_ETAGS[name]
    headers = {"ETag": etag, "Cache-Control": "private, no-cache", "X-Content-Type-Options": "nosniff"}
    if _not_modified(request, etag):
        return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers=headers)
    return Response(STATIC[name], media_type=STATIC_TYPES[name], headers=headers)


@router.get("/")
def architectures_page(
    state: StateDep, page: Page = 1,
    q: Annotated[str, Query(max_length=200, pattern=r"^[^\x00]*$",
                            description="A substring of the model name, or a prefix of the hash.")] = "",
) -> HTMLResponse:
    """Every stored plan key, newest first, searchable by model name or hash prefix."""
    search = q.strip()
    with state.db.read_session() as session:
        summaries, total = repository.key_summaries(session=session, search=search or None, limit=PAGE_SIZE,
                                                    offset=(page - 1) * PAGE_SIZE)
    return _page("architectures.html", nav="architectures", summaries=summaries, total=total, q=search, page=page,
                 has_more=page * PAGE_SIZE < total)


@router.get("/plans/{model_hash}")
def key_page(
    request: Request, state: StateDep, key: KeyDep, algorithm: Planner = DEFAULT_PLANNER,
    stages: Annotated[int, Query(ge=1, le=MAX_PAGE, description="Page of the trace's stages.")] = 1,
) -> HTMLResponse:
    """One plan key: its plans predicted beside measured, the two pictures, the trace's stages and the lines
    that fetch its ``algorithm`` plan."""
    offset = (stages - 1) * STAGE_PAGE_SIZE
    with state.db.read_session() as session:
        view = views.key_page(repository.find_plans(session=session, key=key),
                              repository.find_frontier(session=session, key=key))
        if view is None:
            rest = key.describe(exclude=("model_hash", "input_shape"))
            raise HTTPException(status.HTTP_404_NOT_FOUND,
                                detail=f"model_hash: nothing is stored for {key.model_hash} with input_shape "
                                       f"{key.input_shape_text or '()'}, {rest}")
        shown = repository.trace_stages(session=session, trace_id=view.trace.trace_id, limit=STAGE_PAGE_SIZE,
                                        offset=offset)
    server = str(request.base_url).rstrip("/")
    lines = fetch_lines(view.key, model=view.model, server=server, algorithm=algorithm,
                        read_token=state.settings.read_token_required)
    return _page("key.html", nav="architectures", view=view, algorithm=algorithm, lines=lines, stages=shown,
                 stage_offset=offset, stage_page=stages, stage_page_size=STAGE_PAGE_SIZE,
                 stage_pages=max(1, -(-view.num_stages // STAGE_PAGE_SIZE)))


def _picture(request: Request, state: StateDep, kind: str, key: PlanKey, algorithm: str,
             draw: Callable[[Session], str]) -> Response:
    """A picture of ``key``, drawn at most once per version of its rows, and 304 while the browser has it."""
    with state.db.read_session() as session:
        version = repository.key_version(session=session, key=key)
        if not version[0]:
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"model_hash: nothing is stored for {key.model_hash}")
        name = (kind, key, algorithm, version)
        etag = _etag(name)
        headers = {**PICTURE_HEADERS, "ETag": etag}
        if _not_modified(request, etag):
            return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers=headers)
        cache: PictureCache = request.app.state.ui_pictures
        picture = cache.get_or_make(name, lambda: draw(session))
    return Response(picture, media_type="image/svg+xml", headers=headers)


@router.get("/plans/{model_hash}/timeline.svg")
def timeline_svg(request: Request, state: StateDep, key: KeyDep, algorithm: Planner = DEFAULT_PLANNER) -> Response:
    """Memory over one measured training step: no checkpointing and the ``algorithm`` plan."""

    def draw(session: Session) -> str:
        chosen = repository.get_plan(session=session, key=key, algorithm=algorithm)
        if chosen is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"algorithm: no {algorithm} plan for this key")
        base = (chosen if algorithm == BASELINE_ALGORITHM
                else repository.get_plan(session=session, key=key, algorithm=BASELINE_ALGORITHM))
        return timeline_picture(base, chosen)

    return _picture(request, state, "timeline", key, algorithm, draw)


@router.get("/plans/{model_hash}/frontier.svg")
def frontier_svg(request: Request, state: StateDep, key: KeyDep, algorithm: Planner = DEFAULT_PLANNER) -> Response:
    """Step-time overhead against activation peak: the plans measured, the frontier estimated and measured."""

    def draw(session: Session) -> str:
        return frontier_picture(repository.find_plans(session=session, key=key),
                                repository.find_frontier(session=session, key=key), chosen=algorithm)

    return _picture(request, state, "frontier", key, algorithm, draw)


@router.get("/jobs")
def jobs_page(
    state: StateDep, page: Page = 1,
    state_filter: Annotated[JobState | None, Query(alias="state", description="Only jobs in this state.")] = None,
) -> HTMLResponse:
    """Jobs, newest first: state, progress, and each failure's reason; reloads while one of them runs."""
    with state.db.read_session() as session:
        shown, has_more = jobs.recent_jobs(session=session, state=state_filter, limit=PAGE_SIZE,
                                           offset=(page - 1) * PAGE_SIZE)
    active = any(not job.finished for job in shown)
    return _page("jobs.html", nav="jobs", jobs=shown, has_more=has_more, page=page,
                 state_filter=state_filter.value if state_filter else "", states=[s.value for s in JobState],
                 subject=views.job_subject, refresh=REFRESH_S if active else None)


@router.get("/jobs/{job_id}")
def job_page(job_id: JobId, state: StateDep) -> HTMLResponse:
    """One job: state, progress, message, the reason it failed, its request, and once it succeeded its plans."""
    with state.db.read_session() as session:
        job = jobs.get_job(session=session, job_id=job_id)
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"job_id: no job {job_id}")
    try:
        key = PlanKey.from_dict(job.plan_key) if job.plan_key else None
    except RematError:
        key = None
    request_text = "\n".join(f"{name}: {json.dumps(value)}" for name, value in sorted(job.request.items()))
    return _page("job.html", nav="jobs", job=job, subject=views.job_subject(job), key=key,
                 report=views.job_report(job), request_text=request_text,
                 refresh=None if job.finished else REFRESH_S)


@router.get("/zoo")
def zoo_page(state: StateDep, page: Page = 1) -> HTMLResponse:
    """Zoo batches, newest first, with their jobs counted per state; reloads while one of them runs."""
    with state.db.read_session() as session:
        batches, has_more = zoo.recent_batches(session=session, limit=PAGE_SIZE, offset=(page - 1) * PAGE_SIZE)
    return _page("zoo_list.html", nav="zoo", batches=batches, has_more=has_more, page=page,
                 refresh=REFRESH_S if any(not b.done for b in batches) else None)


@router.get("/zoo/{batch_id}")
def zoo_batch_page(batch_id: BatchId, request: Request, state: StateDep) -> HTMLResponse:
    """A zoo batch: each model's job, state and progress, and once finished its row or its failure's reason
    (finished jobs' rows are kept between reads: a running batch's page reloads every few seconds)."""
    with state.db.read_session() as session:
        batch = zoo.get_batch(session=session, batch_id=batch_id, rows=request.app.state.ui_zoo_rows)
    if batch is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"batch_id: no zoo batch {batch_id}")
    summary = batch.to_dict()
    return _page("zoo_batch.html", nav="zoo", batch=batch, summary=summary,
                 refresh=None if summary["done"] else REFRESH_S)
