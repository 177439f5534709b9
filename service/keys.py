"""Bounds on what the plan database stores, and the patterns the API publishes for key components.

The plan key itself is ``remat.client.plan_key.PlanKey``, the one definition shared with the client and the
worker; this module adds only the service's limits: byte and time caps on trace fields, metadata lengths,
planner names and budgets, the OpenAPI patterns derived from the key's own spellings, and :data:`KEY_BOUNDS`,
how the API takes each key field (the schemas and the plan routes derive their key fields from it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints

from remat.client.devices import QUEUE_PATTERN
from remat.client.errors import InvalidKeyError
from remat.client.plan_key import (
    DEVICE_PATTERN,
    KEY_FIELDS,
    MAX_DIM,
    MAX_DIMS,
    MAX_INPUTS_CHARS,
    MAX_NUMEL,
    MODEL_HASH_PATTERN,
    UNKNOWN,
    PlanKey,
)
from remat.client.precision import SPELLINGS
from remat.client.trace import GRAD_CONVENTIONS, MODES, OPTIONAL_STAGE_BYTES, OPTIONAL_STAGE_MS, Trace
from remat.service.errors import TraceRejectedError

__all__ = ["ALGORITHM_PATTERN", "DEVICE_PATTERN", "DTYPE_PATTERN", "INPUTS_PATTERN", "KEY_BOUNDS", "MAX_DIM",
           "MAX_DIMS", "MAX_FIELD_BYTES", "MAX_FIELD_MS", "MAX_INPUTS_CHARS", "MAX_NUMEL", "METADATA_MAX_CHARS",
           "MODEL_HASH_PATTERN", "PLAN_KEY_DEFAULT", "PRECISION_PATTERN", "QUEUE_PATTERN", "REQUIRED",
           "TORCH_VERSION_PATTERN", "CallInputs", "Dim", "GradsName", "KeyBounds", "ModeName", "ModelHash",
           "api_default", "check_algorithm", "check_budget", "check_storable", "find_bad_text", "trace_key"]

MAX_FIELD_BYTES = 2**40
"""Largest byte count a trace field may hold (1 TiB): sums over 10^6 stages still fit in 64 bits."""
MAX_FIELD_MS = 1e9
def _alternatives(words: Iterable[str]) -> str:
    return "(" + "|".join(re.escape(w) for w in sorted(words, key=lambda t: (-len(t), t))) + ")"


PRECISION_PATTERN = _alternatives(SPELLINGS)
"""Exactly the precision spellings a request may use (remat.client.precision.SPELLINGS)."""
DTYPE_PATTERN = _alternatives((*SPELLINGS, UNKNOWN))
"""Exactly the precision spellings ``PlanKey`` accepts, and ``unknown``."""
TORCH_VERSION_PATTERN = r"[0-9]{1,4}\.[0-9]{1,4}([.+][A-Za-z0-9.+]{0,40})?"
ALGORITHM_PATTERN = r"[a-z0-9][a-z0-9._-]{0,63}"
INPUTS_PATTERN = r"[ -~]*"
"""A call signature's characters: printable ASCII (``remat.client.plan_key.normalize_inputs``)."""
METADATA_MAX_CHARS = {"model": 200, "device_name": 200, "torch_version": 64}
"""Lengths of the columns these trace metadata strings are stored in."""
_ALGORITHM_RE = re.compile(ALGORITHM_PATTERN)

ModelHash = Annotated[str, StringConstraints(pattern=f"^{MODEL_HASH_PATTERN}$")]
Dim = Annotated[int, Field(ge=1, le=MAX_DIM)]
CallInputs = Annotated[str, StringConstraints(max_length=MAX_INPUTS_CHARS, pattern=f"^{INPUTS_PATTERN}$")]
ModeName = Literal[MODES]  # type: ignore[valid-type]  # the trace format's tuple is the one list
GradsName = Literal[GRAD_CONVENTIONS]  # type: ignore[valid-type]
REQUIRED: Any = ...
"""``KeyBounds.default`` of a field the API requires although ``PlanKey`` has a default (pydantic's marker)."""
PLAN_KEY_DEFAULT: Any = object()
"""``KeyBounds.default`` of a field whose API default is ``PlanKey``'s own (required when it has none)."""


@dataclass(frozen=True, slots=True)
class KeyBounds:
    """How the API takes one ``PlanKey`` field: in a JSON body (``PlanKeyIn``), as a query parameter of the
    plan routes, and in a trace upload's metadata (OpenAPI only). The field list is ``PlanKey``'s own: this
    adds the bounds, which the client's normalisation (``PlanKey.__post_init__``) does not publish."""

    type: Any
    """The value's pydantic type in a body; its JSON Schema is also the trace metadata's, except for the fields
    a trace records as full text (``METADATA_MAX_CHARS``: torch_version)."""
    query: Any = None
    """Its type as a query parameter, when not ``type`` (input_shape: comma-separated text)."""
    default: Any = PLAN_KEY_DEFAULT
    """Its default over the API: ``PLAN_KEY_DEFAULT``, ``REQUIRED`` or a value."""
    description: str | None = None
    """The query parameter's description in OpenAPI."""
    example: str | None = None
    """An example query value for OpenAPI."""


KEY_BOUNDS: dict[str, KeyBounds] = {
    "model_hash": KeyBounds(ModelHash, description="Architecture hash."),
    "input_shape": KeyBounds(
        Annotated[list[Dim], Field(max_length=MAX_DIMS)],
        query=Annotated[str, StringConstraints(pattern=r"^([0-9]{1,10}(,[0-9]{1,10}){0,7})?$")],
        description=f"Full input shape, batch included, comma-separated (each dimension 1..{MAX_DIM}).",
        example="32,3,224,224"),
    "inputs": KeyBounds(
        CallInputs,
        description="The training call's signature: each input's name, dtype and shape, and its constants; empty "
                    "for a single-tensor call.",
        example="input_ids: int64[2, 256]; attention_mask: int64[2, 256]; use_cache=False"),
    # A lookup names its precision and device: a plan for one says nothing about another.
    "dtype": KeyBounds(Annotated[str, StringConstraints(pattern=f"^{DTYPE_PATTERN}$")], default=REQUIRED,
                       example="float32"),
    "mode": KeyBounds(ModeName),
    "grads": KeyBounds(GradsName),
    "device": KeyBounds(Annotated[str, StringConstraints(pattern=f"^{DEVICE_PATTERN}$")], default=REQUIRED,
                        description="Device class; an index (cuda:1) is ignored.", example="cuda"),
    # Not the server's torch: a lookup that does not say asks for the newest plan of any.
    "torch_version": KeyBounds(Annotated[str, StringConstraints(pattern=f"^({TORCH_VERSION_PATTERN}|{UNKNOWN})$")],
                               default=UNKNOWN, example="2.15",
                               description="torch version of the training job (major.minor counts); unknown: the "
                                           "newest plan of any."),
}
"""Every ``PlanKey`` field's bounds over the API, by name."""
if set(KEY_BOUNDS) != set(KEY_FIELDS):  # fail at import, naming the field, not deep inside a schema
    raise ImportError(f"service/keys.py: KEY_BOUNDS must bound exactly PlanKey's fields; they differ on "
                      f"{sorted(set(KEY_BOUNDS) ^ set(KEY_FIELDS))}")


def api_default(name: str) -> Any:
    """The default of key field ``name`` in a body or a query; ``REQUIRED`` when a request must give it."""
    bounds = KEY_BOUNDS[name]
    if bounds.default is not PLAN_KEY_DEFAULT:
        return bounds.default
    [f] = [f for f in fields(PlanKey) if f.name == name]
    return f.default if f.default is not MISSING else REQUIRED


def trace_key(trace: Trace, *, content_hash: str | None = None) -> PlanKey:
    """``PlanKey.from_trace``, with malformed key metadata reported as a rejected trace (the upload's 4xx)."""
    try:
        return PlanKey.from_trace(trace, content_hash=content_hash)
    except InvalidKeyError as exc:
        raise TraceRejectedError(str(exc)) from None


def check_algorithm(value: object, field: str = "algorithm") -> str:
    if not isinstance(value, str) or not _ALGORITHM_RE.fullmatch(value):
        raise InvalidKeyError(f"{field}: must be a planner name such as linear, got {value!r}")
    return value


def check_budget(value: int | None, field: str = "budget") -> int | None:
    """A budget in bytes, or None for "minimise the peak"; see NOTE [plan key] in models.py."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_FIELD_BYTES * 2**20:
        raise InvalidKeyError(f"{field}: must be a positive number of bytes, got {value!r}")
    return value


def find_bad_text(value: Any, where: str) -> str | None:
    """Where ``value`` holds a string the databases cannot store, and why; None when all are fine.

    PostgreSQL text cannot hold NUL, and UTF-8 cannot encode a lone surrogate (which ``json.loads`` lets
    through from ``"\\ud800"`` escapes); either would surface as a database error, i.e. a 500.
    """
    if isinstance(value, str):
        if "\x00" in value:
            return f"{where}: contains a NUL character"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"{where}: is not valid Unicode (lone surrogate)"
    elif isinstance(value, Mapping):
        for k, v in value.items():
            problem = find_bad_text(k, where) or find_bad_text(v, f"{where}.{k}")
            if problem:
                return problem
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            problem = find_bad_text(v, f"{where}[{i}]")
            if problem:
                return problem
    return None


def _check_text(value: Any, where: str) -> None:
    problem = find_bad_text(value, where)
    if problem:
        raise TraceRejectedError(problem)


def check_storable(trace: Trace) -> None:
    """Check a parsed trace against the database's limits.

    ``parse_trace`` accepts any non-negative integer; the database holds 64-bit ones, and planners sum over
    stages, so each byte field is capped at :data:`MAX_FIELD_BYTES`. Times are capped likewise so that sums
    stay finite (JSON has no infinity).

    Raises:
        TraceRejectedError: naming the first field out of bounds.
    """
    if trace.input_bytes > MAX_FIELD_BYTES:
        raise TraceRejectedError(f"input_bytes: more than {MAX_FIELD_BYTES} bytes is not plausible")
    if trace.checkpoint_ms > MAX_FIELD_MS:
        raise TraceRejectedError(f"checkpoint_ms: more than {MAX_FIELD_MS:g} ms is not plausible")
    byte_fields = ("output_bytes", "saved_bytes", *OPTIONAL_STAGE_BYTES)
    for i, stage in enumerate(trace.stages):
        for name in byte_fields:
            if getattr(stage, name) > MAX_FIELD_BYTES:
                raise TraceRejectedError(f"stages[{i}].{name}: more than {MAX_FIELD_BYTES} bytes is not plausible")
        for name in OPTIONAL_STAGE_MS:
            value = getattr(stage, name)
            if value is not None and value > MAX_FIELD_MS:
                raise TraceRejectedError(f"stages[{i}].{name}: more than {MAX_FIELD_MS:g} ms is not plausible")
        _check_text(stage.name, f"stages[{i}].name")
        if stage.extra:
            _check_text(dict(stage.extra), f"stages[{i}]")
    if trace.graph is not None:
        for i, vertex in enumerate(trace.graph.vertices):
            if vertex.bytes > MAX_FIELD_BYTES:
                raise TraceRejectedError(f"graph.vertices[{i}].bytes: more than {MAX_FIELD_BYTES} bytes is not "
                                         "plausible")
            _check_text(vertex.name, f"graph.vertices[{i}].name")
            if vertex.extra:
                _check_text(dict(vertex.extra), f"graph.vertices[{i}]")
    meta = trace.metadata
    for key, limit in METADATA_MAX_CHARS.items():
        if isinstance(meta.get(key), str) and len(meta[key]) > limit:
            raise TraceRejectedError(f"{key}: at most {limit} characters, got {len(meta[key])}")
    batch_size = meta.get("batch_size")
    if batch_size is not None and (isinstance(batch_size, bool) or not 1 <= batch_size <= MAX_DIM):
        raise TraceRejectedError(f"batch_size: must be in 1..{MAX_DIM}, got {batch_size}")
    for key, value in meta.items():
        _check_text(key, "trace metadata key")
        _check_text(value, key)
