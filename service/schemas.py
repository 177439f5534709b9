"""Request and response bodies of the HTTP API (Pydantic), and the OpenAPI schema of a trace upload.

Response models mirror the ``to_dict()`` of the records in records.py: the plan routes serialise records
straight to JSON bytes (that is what the cache stores), and the models here are what OpenAPI publishes and
what the schemathesis test holds those bytes to.

A trace upload is *not* a Pydantic model: it is parsed by ``remat.client.trace.loads_trace`` so that the
service and the CLI give the same one-line errors. :data:`TRACE_REQUEST_BODY` describes it for OpenAPI and
must accept exactly what ``loads_trace`` plus ``check_storable`` accept (tests/service/test_schemathesis.py).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    create_model,
    model_validator,
)

from remat.client.devices import DEVICES
from remat.client.hf_models import MAX_SEQ_LEN
from remat.client.job_state import JobState
from remat.client.measurement import STORED_FIELDS, Measurement
from remat.client.plan_key import PlanKey
from remat.client.trace import OPTIONAL_STAGE_BOOLS, OPTIONAL_STAGE_BYTES, OPTIONAL_STAGE_MS, TRACE_FORMAT
from remat.client.zoo_batch import ZOOS, ZooRow
from remat.service.keys import (
    ALGORITHM_PATTERN,
    KEY_BOUNDS,
    MAX_DIM,
    MAX_DIMS,
    MAX_FIELD_BYTES,
    MAX_FIELD_MS,
    MAX_NUMEL,
    METADATA_MAX_CHARS,
    PRECISION_PATTERN,
    QUEUE_PATTERN,
    Dim,
    GradsName,
    ModeName,
    api_default,
    find_bad_text,
)


def _storable(value: Any) -> Any:
    problem = find_bad_text(value, "value")
    if problem:
        raise ValueError(problem.removeprefix("value: "))
    return value


SafeText = Annotated[str, StringConstraints(max_length=200), AfterValidator(_storable)]
Bytes = Annotated[int, Field(ge=0, le=MAX_FIELD_BYTES)]
Millis = Annotated[float, Field(ge=0, le=MAX_FIELD_MS, allow_inf_nan=False)]
Device = Literal[DEVICES]  # type: ignore[valid-type]  # the names of remat.client.devices, whatever they are
WIRE_TYPES: dict[Any, Any] = {tuple[int, ...]: list[int], tuple[int, ...] | None: list[int] | None,
                              Mapping[str, Any]: dict[str, Any]}
"""A record field's type in JSON, where it is not the field's own (tuples are lists, mappings objects)."""


class ErrorOut(BaseModel):
    """Every 4xx/5xx body: one line that names the offending field first."""

    detail: str


# --- plans ------------------------------------------------------------------------------------------------

class KeyBody(BaseModel):
    """What ``PlanKeyIn`` adds to its derived fields: no unknown field, and the way to the one ``PlanKey``."""

    model_config = ConfigDict(extra="forbid")

    def to_key(self) -> PlanKey:
        """The one PlanKey: every normalisation and bound is its own."""
        return PlanKey(**self.model_dump())


def _plan_key_models() -> tuple[type[KeyBody], type[BaseModel]]:
    """``PlanKeyIn`` and ``PlanKeyOut``: ``PlanKey``'s fields in its order, bounded by ``KEY_BOUNDS`` on the way
    in (its defaults: service/keys.py ``api_default``; ``torch_version`` ``unknown`` matches a plan of any torch
    version), as ``PlanKey.to_dict()`` writes them on the way out."""
    hints = typing.get_type_hints(PlanKey)
    key_fields = dataclasses.fields(PlanKey)
    key_in = create_model(
        "PlanKeyIn", __base__=KeyBody,
        __doc__="The plan key (``remat.client.plan_key.PlanKey``): what a plan is valid for, less algorithm and "
                "budget.",
        **{f.name: (KEY_BOUNDS[f.name].type, api_default(f.name)) for f in key_fields})
    key_out = create_model("PlanKeyOut", **{f.name: (WIRE_TYPES.get(hints[f.name], hints[f.name]), ...)
                                            for f in key_fields})
    return key_in, key_out


PlanKeyIn, PlanKeyOut = _plan_key_models()


class PlanOut(BaseModel):
    """A plan in the wire form of ``remat.client.plan.Plan.to_dict()`` (planner-specific extras allowed)."""

    model_config = ConfigDict(extra="allow")

    algorithm: str
    checkpoints: list[int]
    predicted_peak_bytes: int
    baseline_peak_bytes: int
    cost_model: str
    num_stages: int
    recompute_ms: float | None
    step_ms: float | None
    budget_bytes: int | None
    schema_version: int
    dropped_vertices: list[int] | None = None
    """A graph plan's recomputed op-graph vertices (absent for a chain plan, whose ``checkpoints`` say it)."""
    num_vertices: int | None = None
    lower_bound_bytes: int | None = None
    """A graph plan's lower bound: no plan of the step peaks below it (``Plan.lower_bound_bytes``)."""
    lower_bound_at: str | None = None
    """The event of the step where that memory is forced."""
    certified_bound_bytes: int | None = None
    """A graph plan's certified bound: no one-level graph plan peaks below it (``Plan.certified_bound_bytes``)."""
    certified_by: str | None = None
    """How that bound was certified."""
    planned_by: str | None = None
    """A budget point that is a registered planner's plan (a nested or graph plan below every chain plan): that
    planner's name."""


def _measurement_out() -> type[BaseModel]:
    """The measurement as the API returns it: ``Measurement.to_dict()``'s fields, derived from the dataclass."""
    hints = typing.get_type_hints(Measurement)
    model_fields: dict[str, Any] = {f.name: (WIRE_TYPES.get(hints[f.name], hints[f.name]), ...)
                                    for f in dataclasses.fields(Measurement)}
    model_fields["prediction_error"] = (float | None, ...)
    model_fields["activation_measured_bytes"] = (int | None, ...)
    model_fields["baseline_activation_measured_bytes"] = (int | None, ...)
    return create_model("MeasurementOut", __doc__="A validation run of a plan (remat.client.measurement).",
                        **model_fields)


MeasurementOut = _measurement_out()


class TraceInfoOut(BaseModel):
    trace_id: int
    content_sha256: str
    model: str | None
    device_name: str | None
    torch_version: str | None
    batch_size: int | None
    created_at: datetime
    derived_from: list[int] = []
    """Sizes of the profiles this trace was derived from (empty: a profile): batch sizes, or sequence lengths
    where ``derived_along`` is ``seq_len``; see ``derived``."""
    derived_along: Literal["batch", "seq_len"] | None = None
    """What ``derived_from`` counts; None for a profile."""


class StepTimeline(BaseModel):
    """Memory over one measured training step (remat.worker.measure): bucket starts and their highest level."""

    ops: int
    """Samples in the step, recomputation included: aten ops (CPU) or allocator events (CUDA), see ``sample``."""
    backward_op: int
    """The sample index where backward starts."""
    op_index: list[int]
    bytes: list[int]
    """Highest activation level (bytes above the step's baseline) within each bucket; on CUDA the bytes the
    step requested from the caching allocator (before its 512-byte rounding)."""
    sample: str = "aten op"
    """What one sample is: ``aten op`` (CPU meter) or ``allocator event`` (CUDA allocator history). Timelines
    stored before CUDA recorded one carry no such key and were all per aten op."""


class TimelineOut(BaseModel):
    """``GET /v1/plans/{model_hash}/timeline``: one plan's measured step over time, beside its prediction."""

    key: PlanKeyOut
    algorithm: str
    checkpoints: list[int]
    predicted_peak_bytes: int
    measured_peak_bytes: int | None
    timeline: StepTimeline


class PlanRecordOut(BaseModel):
    """A stored plan with its key, the trace it came from and the measurements of its checkpoints."""

    plan_id: int
    key: PlanKeyOut
    plan: PlanOut
    trace: TraceInfoOut
    derived: bool = False
    """Planned on a trace derived at this batch size from profiles at others, and not yet validated by a
    measured step: its prediction is as good as the fit (docs/service.md, "Any batch size")."""
    measurements: list[MeasurementOut]
    created_at: datetime
    updated_at: datetime


class FrontierOut(BaseModel):
    """``GET /v1/plans/{model_hash}/frontier``: the key's Pareto frontier, tightest peak first."""

    key: PlanKeyOut
    points: list[PlanRecordOut]


class PlansPage(BaseModel):
    data: list[PlanRecordOut]
    count: int
    """How many plans match the filters in all (``data`` holds one page of them)."""


class DeferredPlanOut(BaseModel):
    algorithm: str
    job_id: str | None
    """The ``plan`` job computing it (``GET /v1/jobs/{id}``); None when its plan was already stored."""


class SkippedPlanOut(BaseModel):
    algorithm: str
    reason: str


class TraceStoredOut(BaseModel):
    key: PlanKeyOut
    trace_id: int
    content_sha256: str
    created: bool
    """False when the same trace content was stored before."""
    superseded_by: int | None = None
    """A newer trace of the same key, when one is stored: this trace's plans were computed but not stored, and
    nothing was deferred (latest profile wins). Null otherwise."""
    plans: list[PlanOut]
    """The registered planners' plans computed inside the request, one per algorithm."""
    frontier: list[PlanOut]
    """The Pareto frontier computed inside the request (``budget`` plans, tightest peak first; empty when
    deferred or skipped): ``GET /v1/plans/{hash}?algorithm=budget&budget=BYTES`` picks from it."""
    deferred: list[DeferredPlanOut]
    """Planners run as a job on the ``plan`` queue (too slow for a request at this stage count)."""
    skipped: list[SkippedPlanOut]
    """Planners not run at all at this stage count, with why."""


# --- measurements -----------------------------------------------------------------------------------------



def _measurement_in_type(name: str, hint: Any) -> Any:
    """Bounds for an incoming measurement field: bytes and times as stored, text the database can hold."""
    if name in ("checkpoints", "dropped_vertices"):
        return Annotated[list[Annotated[int, Field(ge=1, le=10**7)]], Field(max_length=10**6)] | None
    if name == "extra":
        return Annotated[dict[str, Any], AfterValidator(_storable)]
    if name == "grad_max_abs_diff":
        return Annotated[float, Field(ge=0, allow_inf_nan=False)] | None
    if hint == int | None:
        return Bytes | None
    if hint == float | None:
        return Millis | None
    if hint == str | None:
        return SafeText | None
    return hint


def _measurement_create() -> type[BaseModel]:
    """``POST /v1/measurements``'s body: the plan it belongs to, then every stored measurement field."""
    hints = typing.get_type_hints(Measurement)
    model_fields: dict[str, Any] = {
        "key": (PlanKeyIn, ...),
        "algorithm": (Annotated[str, StringConstraints(pattern=f"^{ALGORITHM_PATTERN}$")], ...),
        "budget_bytes": (Annotated[int, Field(ge=1, le=MAX_FIELD_BYTES)] | None, None),
    }
    for name in STORED_FIELDS:
        default: Any = Field(default_factory=dict) if name == "extra" else None
        model_fields[name] = (_measurement_in_type(name, hints[name]), default)
    return create_model("MeasurementCreate", __config__=ConfigDict(extra="forbid"),
                        __doc__="A validation run of a stored plan (remat.client.measurement).", **model_fields)


MeasurementCreate = _measurement_create()


# --- jobs -------------------------------------------------------------------------------------------------

class JobCreate(BaseModel):
    """A request to profile a zoo model, plan it with every algorithm and validate the plans."""

    model_config = ConfigDict(extra="forbid")

    model: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/+-]{0,199}$")]
    """Zoo name, e.g. ``torchvision:resnet152`` or ``resnet152``, or a Hugging Face architecture of remat's
    allow-list, ``hf:gpt2`` (never a path to a config.json: workers do not read files a request names)."""
    batch_size: Annotated[int, Field(ge=1, le=65536)]
    input_shape: Annotated[list[Dim], Field(min_length=1, max_length=MAX_DIMS - 1)]
    """Per-sample input shape, batch excluded, e.g. ``[3, 224, 224]``; ``[seq_len]`` for an hf: token model."""
    model_kwargs: Annotated[dict[str, Any] | None, Field(max_length=64)] = None
    """Fields of an ``hf:`` model's configuration, e.g. ``{"n_layer": 6}``: each one the configuration has,
    each value a JSON scalar or a list of them. Other models are built with their default arguments."""
    seq_len: Annotated[int | None, Field(ge=1, le=MAX_SEQ_LEN)] = None
    """Tokens per sample of an ``hf:`` token model (its ``input_shape`` is ``[seq_len]``; default: that)."""
    dtype: Annotated[str, StringConstraints(pattern=f"^{PRECISION_PATTERN}$")] = "float32"
    """The step's precision: ``float32``, ``bfloat16``, ``autocast_bfloat16``... (any spelling ``remat-client
    plan --dtype`` accepts; stored in its canonical form)."""
    device: Device = "cuda"
    mode: ModeName = "train"
    grads: GradsName = "none"
    queue: Annotated[str | None, StringConstraints(pattern=f"^{QUEUE_PATTERN}$")] = None
    """Queue of the workers to run it (default: the device, ``cpu`` or ``cuda``); ``cuda-h100`` for workers
    started with ``--queues cuda-h100``. Must be of the requested device."""

    @model_validator(mode="after")
    def _plausible_size(self) -> JobCreate:
        numel = self.batch_size
        for d in self.input_shape:
            numel *= d
        if numel > MAX_NUMEL:
            raise ValueError(f"input_shape: batch_size x input_shape is {numel} elements, more than the "
                             f"{MAX_NUMEL} allowed")
        return self


JobStateName = Literal[tuple(state.value for state in JobState)]  # type: ignore[valid-type]
"""A job state as the API spells it (``remat.client.job_state.JobState``): an inline enum of plain strings."""


class JobOut(BaseModel):
    """A job as stored (``remat.service.records.JobRecord``)."""

    id: str
    kind: Literal["profile", "plan"]
    state: JobStateName
    progress: float
    """Fraction of the work done, 0 to 1; ``message`` says which phase runs."""
    message: str | None
    error: str | None
    """Why a failed job failed, in words a person can act on."""
    request: dict[str, Any]
    result: dict[str, Any] | None
    """At the end of a profile job: the plan key, the trace id and every plan with its measurement."""
    plan_key: dict[str, Any] | None
    """The plan key, once a worker has built the model."""
    queue: str | None
    leader_id: str | None
    """The job this one follows: an identical request that was already running when it was submitted."""
    attempts: int
    lease_owner: str | None
    lease_expires_at: datetime | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class JobsPage(BaseModel):
    data: list[JobOut]
    count: int


# --- health -----------------------------------------------------------------------------------------------

class ComponentHealth(BaseModel):
    ok: bool
    detail: str | None
    """The error when not ok; ``disabled`` for a cache that is not configured."""


class HealthOut(BaseModel):
    status: Literal["ok", "degraded", "unavailable"]
    """ok: all reachable; degraded: the cache or the broker is down (reads go to the database, new jobs wait
    for the broker); unavailable: no database."""
    database: ComponentHealth
    cache: ComponentHealth
    broker: ComponentHealth
    """The Celery broker that jobs are sent through."""


# --- trace upload (OpenAPI only; parsed by remat.client.trace) --------------------------------------------

def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


_TEXT = {"type": "string", "pattern": "^[^\\x00]*$"}
_BYTES = {"type": "integer", "minimum": 0, "maximum": MAX_FIELD_BYTES}
_MS = {"type": "number", "minimum": 0, "maximum": MAX_FIELD_MS}
_STAGE = {  # derived from the trace format's own field lists: one definition
    "type": "object",
    "required": ["name", "output_bytes", "saved_bytes"],
    "properties": {
        "name": _TEXT,
        "output_bytes": _BYTES,
        "saved_bytes": _BYTES,
        **dict.fromkeys(OPTIONAL_STAGE_BYTES, _BYTES),
        **{name: {"type": "boolean"} for name in OPTIONAL_STAGE_BOOLS},
        **{name: _nullable(_MS) for name in OPTIONAL_STAGE_MS},
    },
}


def _key_metadata(name: str) -> dict[str, Any]:
    """A key field in a trace's metadata: its body schema (``KEY_BOUNDS``), or text where the trace records the
    full value (torch_version: the whole version string, which plans key on the major.minor of)."""
    if name in METADATA_MAX_CHARS:
        return {**_TEXT, "maxLength": METADATA_MAX_CHARS[name]}
    return TypeAdapter(KEY_BOUNDS[name].type).json_schema()


TRACE_SCHEMA: dict[str, Any] = {
    "title": "Trace",
    "description": f"A layer memory trace in the {TRACE_FORMAT} format (docs/cost-model.md); further fields "
                   "are kept. Byte fields are capped at 2^40, times at 10^9 ms.",
    "type": "object",
    "required": ["format", "input_bytes", "stages"],
    "properties": {
        "format": {"type": "string", "enum": [TRACE_FORMAT]},
        "input_bytes": _BYTES,
        "stages": {"type": "array", "minItems": 1, "items": _STAGE},
        "model": _nullable({**_TEXT, "maxLength": METADATA_MAX_CHARS["model"]}),
        **{f.name: _nullable(_key_metadata(f.name)) for f in dataclasses.fields(PlanKey)},
        "device_name": _nullable({**_TEXT, "maxLength": METADATA_MAX_CHARS["device_name"]}),
        "batch_size": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_DIM}),
    },
}
TRACE_REQUEST_BODY: dict[str, Any] = {
    "requestBody": {"required": True, "content": {"application/json": {"schema": TRACE_SCHEMA}}},
}


class ZooCreate(BaseModel):
    """A zoo run: one profiling job per classification model the filter selects, sharing everything else."""

    model_config = ConfigDict(extra="forbid")

    zoo: Literal[ZOOS] = "torchvision"  # type: ignore[valid-type]  # remat.client.zoo_batch's zoos
    filter: Annotated[str | None, StringConstraints(pattern=r"^[A-Za-z0-9_*?\[\]!,.-]{1,200}$")] = None
    """Glob over the zoo's model names, e.g. ``resnet*``; several separated by commas. Default: every model."""
    batch_size: Annotated[int | None, Field(ge=1, le=65536)] = None
    """Default: 4 on cpu, 32 on cuda."""
    input_shape: Annotated[list[Dim] | None, Field(min_length=1, max_length=MAX_DIMS - 1)] = None
    """Per-sample shape for every model that takes images; default: each model's own (scaled to 128 px on cpu
    where it can be)."""
    seq_len: Annotated[int | None, Field(ge=1, le=MAX_SEQ_LEN)] = None
    """Tokens per sample for every hf: token model; default: 128 on cpu, 512 on cuda."""
    dtype: Annotated[str, StringConstraints(pattern=f"^{PRECISION_PATTERN}$")] = "float32"
    device: Device = "cuda"
    grads: GradsName = "none"
    queue: Annotated[str | None, StringConstraints(pattern=f"^{QUEUE_PATTERN}$")] = None
    refresh: bool = False
    """Profile again models whose plans are stored (otherwise their jobs end at once with the stored plans)."""


class ZooModelOut(BaseModel):
    """One model of a zoo batch: its job's state and, once finished, its summary row."""

    model: str
    job_id: str
    state: JobStateName
    progress: float
    message: str | None
    row: ZooRow | None


class ZooOut(BaseModel):
    """A zoo batch (``remat.service.zoo.ZooBatch.to_dict``)."""

    id: str
    zoo: str
    filter: str | None
    request: dict[str, Any]
    created_at: datetime
    total: int
    finished: int
    counts: dict[str, int]
    done: bool
    progress: float
    models: list[ZooModelOut]
