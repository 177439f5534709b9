"""``GET /v1/plans/{model_hash}`` (one plan, through the cache) and ``GET /v1/plans`` (search)."""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Path, Query, status
from fastapi.responses import Response
from sqlalchemy.orm import Session

from remat.client.derived_trace import inputs_at_batch, inputs_at_length, token_length
from remat.client.plan import BUDGET_ALGORITHM
from remat.client.plan_key import PlanKey, normalize_device, normalize_dtype
from remat.client.planning.planners import DEFAULT_PLANNER, PLANNERS
from remat.service import repository
from remat.service.api.deps import OPTIONAL_AUTH, READ_RESPONSES, StateDep, require_reader
from remat.service.api.service_route import ServiceRoute
from remat.service.derived_plans import store_derived
from remat.service.keys import (
    DEVICE_PATTERN,
    DTYPE_PATTERN,
    KEY_BOUNDS,
    MAX_FIELD_BYTES,
    MODEL_HASH_PATTERN,
    REQUIRED,
    api_default,
)
from remat.service.schemas import ErrorOut, FrontierOut, PlanRecordOut, PlansPage, TimelineOut

router = APIRouter(prefix="/v1/plans", tags=["plans"], dependencies=[Depends(require_reader)], route_class=ServiceRoute)

Algorithm = Literal[(*PLANNERS, BUDGET_ALGORITHM)]  # type: ignore[valid-type]  # the registry is the one list
PATH_FIELD = "model_hash"
"""The key field in the path of ``/v1/plans/{model_hash}…``; every other one is a query parameter."""
JSON_MEDIA = "application/json"


def _json(content: object) -> bytes:
    return json.dumps(content, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _key_parameter(field: dataclasses.Field[Any]) -> inspect.Parameter:
    """One ``PlanKey`` field as a parameter of the key dependency, bounded and documented by ``KEY_BOUNDS``."""
    bounds = KEY_BOUNDS[field.name]
    docs: dict[str, Any] = {"description": bounds.description} if bounds.description else {}
    if bounds.example is not None:
        docs["examples"] = [bounds.example]
    where = Path(**docs) if field.name == PATH_FIELD else Query(**docs)
    default = api_default(field.name)
    return inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY,
                             annotation=Annotated[bounds.query or bounds.type, where],
                             default=inspect.Parameter.empty if default is REQUIRED else default)


def _plan_key(**fields: Any) -> PlanKey:
    """The plan key of a ``/v1/plans/{model_hash}…`` request, from its path and query: one definition for
    every route that reads one key. Its parameters are ``PlanKey``'s fields (the signature below)."""
    return PlanKey(**fields)


_plan_key.__signature__ = inspect.Signature(  # type: ignore[attr-defined]  # FastAPI reads the parameters here
    [_key_parameter(f) for f in dataclasses.fields(PlanKey)], return_annotation=PlanKey)
KeyDep = Annotated[PlanKey, Depends(_plan_key)]


@router.get("/{model_hash}", response_model=PlanRecordOut,
            responses={404: {"model": ErrorOut, "description": "No plan is stored for this key."},
                       422: {"model": ErrorOut, "description": "A malformed query, or (algorithm=budget) a budget "
                                                               "below the smallest feasible peak."},
                       **READ_RESPONSES},
            openapi_extra=OPTIONAL_AUTH)
def read_plan(
    state: StateDep,
    key: KeyDep,
    algorithm: Algorithm = DEFAULT_PLANNER,
    budget: Annotated[int | None, Query(ge=1, le=MAX_FIELD_BYTES, description="Bytes; omit for min peak.")] = None,
    batch_size: BatchSizeQuery = None,
    seq_len: SeqLenQuery = None,
) -> Response:
    """The plan for one key, algorithm and budget, with its prediction, provenance and measurements.

    Served from Redis when cached (header ``X-Remat-Cache: hit``); a miss reads the database and fills the
    cache. ``algorithm=budget&budget=BYTES``: the fastest plan whose predicted peak fits, picked from the
    key's stored Pareto frontier (its ``budget_bytes`` is its own peak, the tightest budget it answers);
    read from the database every time, as any write to the frontier changes which budgets it answers.

    A key never profiled whose architecture is stored at two or more other batch sizes (same call, precision
    and conventions) is answered from a trace derived at its batch size, stored with its plans on the first
    read; such a plan says ``derived: true`` until a measured step of it is stored. ``batch_size`` replaces
    ``input_shape``'s first dimension. A token model's key (token ids first) is answered likewise at a
    sequence length never profiled from its profiles at the same batch and enough other lengths (three for
    attention that holds its scores); ``seq_len`` replaces ``input_shape``'s second dimension.
    """
    key = _at_size(key, batch_size, seq_len)
    if algorithm == BUDGET_ALGORITHM:
        return _read_budget_plan(state, key, budget)
    name = state.cache.key_name(key, algorithm, budget)
    cached = state.cache.get(name)
    if cached is not None:
        return Response(content=cached, media_type=JSON_MEDIA, headers={"X-Remat-Cache": "hit"})
    record = _read_or_derive(state, lambda session: repository.get_plan(
        session=session, key=key, algorithm=algorithm, budget_bytes=budget), key)
    if record is None:
        budget_text = f"budget {budget} bytes" if budget else "no budget"
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            detail=f"model_hash: no {algorithm} plan ({budget_text}) for {key.model_hash} with input_shape "
                   f"{key.input_shape_text or '()'}, {key.describe(exclude=('model_hash', 'input_shape'))}; POST its "
                   f"trace to /v1/traces or a profiling job to /v1/jobs")
    body = _json(record.to_dict())
    state.cache.set(name, body)
    return Response(content=body, media_type=JSON_MEDIA, headers={"X-Remat-Cache": "miss"})


BatchSizeQuery = Annotated[int | None, Query(ge=1, le=2**31 - 1, description="The batch size: replaces "
                                            "input_shape's first dimension, and the numbers of inputs equal to it "
                                            "(a plan for any batch size; see read_plan)")]


SeqLenQuery = Annotated[int | None, Query(ge=1, le=2**31 - 1, description="The sequence length of a token "
                                          "model's key: replaces input_shape's second dimension, and the numbers "
                                          "of inputs equal to it (a plan for any length; see read_plan)")]


def _at_size(key: PlanKey, batch_size: int | None, seq_len: int | None) -> PlanKey:
    if batch_size is not None:
        if not key.input_shape:
            raise HTTPException(422, detail="batch_size: needs input_shape (its first dimension is the batch)")
        # a call of several inputs names its batch in its signature too (input_ids: int64[2, 256]): it follows
        key = dataclasses.replace(key, input_shape=(batch_size, *key.input_shape[1:]),
                                  inputs=inputs_at_batch(key.inputs, key.input_shape[0], batch_size))
    if seq_len is not None:
        length = token_length(key.input_shape, key.inputs)
        if length is None:
            raise HTTPException(422, detail="seq_len: needs a token model's key (input_shape [batch, seq_len] and "
                                            "inputs that start with integer token ids)")
        key = dataclasses.replace(key, input_shape=(key.input_shape[0], seq_len),
                                  inputs=inputs_at_length(key.inputs, length, seq_len))
    return key


def _read_or_derive(state: StateDep, read: Callable[[Session], Any], key: PlanKey) -> Any:
    """``read`` in a read session; on a miss, the key's trace derived from its profiles at other batch sizes
    and stored with its plans (service/derived_plans.py), then ``read`` again."""
    with state.db.read_session() as session:
        found = read(session)
    if found or not store_derived(state.db, state.settings, key):
        return found
    with state.db.read_session() as session:
        return read(session)


def _read_budget_plan(state: StateDep, key: PlanKey, budget: int | None) -> Response:
    if budget is None:
        raise HTTPException(422,
                            detail="budget: required with algorithm=budget (bytes of activation memory)")
    def pick(session: Session) -> tuple[Any, int] | None:  # None: no frontier stored (derived on that miss)
        record, smallest = repository.pick_budget_plan(session=session, key=key, budget_bytes=budget)
        return None if smallest is None else (record, smallest)

    picked = _read_or_derive(state, pick, key)
    if picked is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND,
                            detail=f"model_hash: no frontier is stored for {key.model_hash} with input_shape "
                                   f"{key.input_shape_text or '()'} and these conventions; it is computed when a "
                                   f"trace is stored (POST /v1/traces or a profiling job)")
    record, smallest = picked
    if record is None:
        raise HTTPException(422,
                            detail=f"budget: {budget} bytes is below the smallest feasible peak, {smallest} bytes")
    return Response(content=_json(record.to_dict()), media_type=JSON_MEDIA)


@router.get("/{model_hash}/frontier", response_model=FrontierOut,
            responses={404: {"model": ErrorOut, "description": "No frontier is stored for this key."},
                       **READ_RESPONSES},
            openapi_extra=OPTIONAL_AUTH)
def read_frontier(state: StateDep, key: KeyDep, batch_size: BatchSizeQuery = None,
                  seq_len: SeqLenQuery = None) -> Response:
    """Every plan not dominated in (predicted peak, estimated recompute time), tightest peak first, with the
    measurements of those a validation step ran: the key's time–memory curve (derived at a batch size never
    profiled, as ``read_plan`` says, and at a sequence length never profiled)."""
    key = _at_size(key, batch_size, seq_len)
    points = _read_or_derive(state, lambda session: repository.find_frontier(session=session, key=key), key)
    if not points:
        raise HTTPException(status.HTTP_404_NOT_FOUND,
                            detail=f"model_hash: no frontier is stored for {key.model_hash} with input_shape "
                                   f"{key.input_shape_text or '()'} and these conventions")
    body = {"key": points[0].key.to_dict(), "points": [p.to_dict() for p in points]}
    return Response(content=_json(body), media_type=JSON_MEDIA)


@router.get("/{model_hash}/timeline", response_model=TimelineOut,
            responses={404: {"model": ErrorOut, "description": "No plan, or no measured timeline, for this key."},
                       **READ_RESPONSES},
            openapi_extra=OPTIONAL_AUTH)
def read_timeline(state: StateDep, key: KeyDep, algorithm: Algorithm = DEFAULT_PLANNER) -> Response:
    """Memory over one measured training step with this plan (its newest measurement that has one): the level
    after every aten op (CPU) or allocator event (CUDA, requested bytes), bucketed to at most 400 points that
    keep each bucket's highest level, and where backward starts; 404 for measurements stored before
    timelines were recorded."""
    with state.db.read_session() as session:
        record = repository.get_plan(session=session, key=key, algorithm=algorithm)
    if record is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND,
                            detail=f"model_hash: no {algorithm} plan for {key.model_hash} with input_shape "
                                   f"{key.input_shape_text or '()'} and these conventions")
    measured = record.timeline_measurement
    if measured is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND,
                            detail=f"algorithm: the {algorithm} plan's measurements carry no timeline (stored "
                                   f"before timelines were recorded)")
    body = {"key": record.key.to_dict(), "algorithm": algorithm, "checkpoints": list(record.plan.checkpoints),
            "predicted_peak_bytes": record.plan.predicted_peak_bytes,
            "measured_peak_bytes": measured.measured_peak_bytes,
            # Timelines stored before CUDA recorded one say nothing of their samples: all were aten ops.
            "timeline": {"sample": "aten op", **measured.extra["timeline"]}}
    return Response(content=_json(body), media_type=JSON_MEDIA)


@router.get("", response_model=PlansPage, responses=READ_RESPONSES, openapi_extra=OPTIONAL_AUTH)
def list_plans(
    state: StateDep,
    model_hash: Annotated[str | None, Query(pattern=f"^{MODEL_HASH_PATTERN}$")] = None,
    model: Annotated[str | None, Query(max_length=200, pattern=r"^[^\x00]*$",
                                       description="Model name as recorded in the trace.")] = None,
    algorithm: Algorithm | None = None,
    device: Annotated[str | None, Query(pattern=f"^{DEVICE_PATTERN}$")] = None,
    dtype: Annotated[str | None, Query(pattern=f"^{DTYPE_PATTERN}$")] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> Response:
    """Search stored plans, newest first; ``count`` is the number of matches across all pages."""
    norm_device = normalize_device(device) if device else None
    norm_dtype = normalize_dtype(dtype) if dtype else None
    with state.db.read_session() as session:
        records, total = repository.list_plans(session=session, model_hash=model_hash, model=model,
                                               algorithm=algorithm, device=norm_device, dtype=norm_dtype,
                                               limit=limit, offset=offset)
    return Response(content=_json({"data": [r.to_dict() for r in records], "count": total}), media_type=JSON_MEDIA)
