"""The plan key and the checks that keep what the database stores within sane bounds.

A :class:`PlanKey` names the conditions a plan is valid for, less the algorithm and budget (see NOTE [plan
key] in models.py): architecture hash, full input shape, dtype, device class, train/eval mode and gradient
convention. It is derived from a trace's metadata by :meth:`PlanKey.from_trace` and from HTTP query
parameters by the API; both go through the same normalisation so that ``torch.float32`` and ``float32``,
or ``cuda:1`` and ``cuda``, find the same plans.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from remat.client.trace import GRAD_CONVENTIONS, MODES, Trace
from remat.service.errors import InvalidKeyError, TraceRejectedError

MAX_FIELD_BYTES = 2**40
"""Largest byte count a trace field may hold (1 TiB): sums over 10^6 stages still fit in 64 bits."""
MAX_FIELD_MS = 1e9
MAX_DIMS = 8
MAX_DIM = 2**31 - 1
MAX_NUMEL = 2**40
UNKNOWN = "unknown"
"""dtype or device class of a trace that does not say: still a key, just not one a profiler would write."""

# The API's OpenAPI schema publishes these same patterns (schemas.py), so that what it declares valid and
# what is accepted here agree.
MODEL_HASH_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._:+-]{0,127}"
DTYPE_PATTERN = r"(torch\.)?[a-z][a-z0-9_]{0,31}"
DEVICE_PATTERN = r"[A-Za-z][A-Za-z0-9_]{0,31}(:[0-9]{1,4})?"
ALGORITHM_PATTERN = r"[a-z0-9][a-z0-9._-]{0,63}"
METADATA_MAX_CHARS = {"model": 200, "device_name": 200, "torch_version": 64}
"""Lengths of the columns these trace metadata strings are stored in."""
_HASH_RE = re.compile(MODEL_HASH_PATTERN)
_DTYPE_RE = re.compile(DTYPE_PATTERN)
_DEVICE_RE = re.compile(DEVICE_PATTERN)
_ALGORITHM_RE = re.compile(ALGORITHM_PATTERN)


def content_sha256(trace: Trace) -> str:
    """Digest of a trace's canonical JSON: equal traces, however formatted, store once."""
    text = json.dumps(trace.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_model_hash(value: object, field: str = "model_hash") -> str:
    if not isinstance(value, str) or not _HASH_RE.fullmatch(value):
        raise InvalidKeyError(f"{field}: must be 1-128 characters of letters, digits and ._:+- starting with "
                              f"a letter or digit, got {value!r}")
    return value


def parse_input_shape(value: str | Sequence[Any], field: str = "input_shape") -> tuple[int, ...]:
    """Parse ``"32,3,224,224"`` or ``[32, 3, 224, 224]``; an empty string or list is a scalar input."""
    if isinstance(value, str):
        text = value.strip()
        try:
            dims: list[Any] = [int(part) for part in text.split(",")] if text else []
        except ValueError:
            raise InvalidKeyError(f"{field}: must be comma-separated positive integers, got {value!r}") from None
    elif isinstance(value, Sequence):
        dims = list(value)
    else:
        raise InvalidKeyError(f"{field}: must be a list of positive integers, got {value!r}")
    if len(dims) > MAX_DIMS:
        raise InvalidKeyError(f"{field}: at most {MAX_DIMS} dimensions, got {len(dims)}")
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= MAX_DIM:
            raise InvalidKeyError(f"{field}: every dimension must be an integer in 1..{MAX_DIM}, got {d!r}")
    if math.prod(dims) > MAX_NUMEL:
        raise InvalidKeyError(f"{field}: {math.prod(dims)} elements is more than the {MAX_NUMEL} allowed")
    return tuple(dims)


def normalize_dtype(value: object, field: str = "dtype") -> str:
    """``torch.float32`` and ``float32`` name the same dtype."""
    if not isinstance(value, str) or not _DTYPE_RE.fullmatch(value):
        raise InvalidKeyError(f"{field}: must be a dtype name such as float32 or bfloat16, got {value!r}")
    return value.removeprefix("torch.")


def normalize_device(value: object, field: str = "device") -> str:
    """Reduce a device to its class: ``cuda:1`` and ``CUDA`` both become ``cuda``."""
    if not isinstance(value, str) or not _DEVICE_RE.fullmatch(value):
        raise InvalidKeyError(f"{field}: must be a device class such as cpu or cuda, got {value!r}")
    return value.split(":", 1)[0].lower()


def check_choice(value: object, choices: Sequence[str], field: str) -> str:
    if value not in choices:
        raise InvalidKeyError(f"{field}: must be one of {', '.join(choices)}, got {value!r}")
    return str(value)


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


@dataclass(kw_only=True, slots=True, frozen=True)
class PlanKey:
    """Everything a plan depends on except the algorithm and the budget."""

    model_hash: str
    """Architecture hash from the client (graph, module types and configuration, parameter shapes)."""
    input_shape: tuple[int, ...]
    """Full input shape, batch dimension included."""
    dtype: str
    device: str
    """Device class (``cpu``, ``cuda``), not a device index or model name."""
    mode: str = "train"
    grads: str = "none"
    """``none``: gradients set to None between steps (``zero_grad()``'s default); ``kept``: kept allocated."""

    def __post_init__(self) -> None:
        check_model_hash(self.model_hash)
        object.__setattr__(self, "input_shape", parse_input_shape(self.input_shape))
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        object.__setattr__(self, "device", normalize_device(self.device))
        check_choice(self.mode, MODES, "mode")
        check_choice(self.grads, GRAD_CONVENTIONS, "grads")

    @property
    def input_shape_text(self) -> str:
        """The shape as stored and as passed in URLs: ``32,3,224,224``."""
        return ",".join(map(str, self.input_shape))

    @classmethod
    def from_trace(cls, trace: Trace, *, content_hash: str | None = None) -> PlanKey:
        """The key a trace's plans are stored under.

        A trace without ``model_hash`` (written by hand) is keyed by its content digest, ``trace:<hex>``;
        missing dtype and device read as ``unknown``, missing mode and grads as the defaults.

        Raises:
            TraceRejectedError: a metadata field is malformed; the message names it.
        """
        meta = trace.metadata

        def given(name: str, default: Any) -> Any:  # absent and null both mean "not recorded"
            value = meta.get(name)
            return default if value is None else value

        model_hash = given("model_hash", None)
        if model_hash is None:
            model_hash = f"trace:{(content_hash or content_sha256(trace))[:40]}"
        try:
            return cls(model_hash=model_hash, input_shape=tuple(given("input_shape", ())),
                       dtype=given("dtype", UNKNOWN), device=given("device", UNKNOWN),
                       mode=given("mode", "train"), grads=given("grads", "none"))
        except InvalidKeyError as exc:
            raise TraceRejectedError(str(exc)) from None

    def to_dict(self) -> dict[str, Any]:
        return {"model_hash": self.model_hash, "input_shape": list(self.input_shape), "dtype": self.dtype,
                "device": self.device, "mode": self.mode, "grads": self.grads}

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> PlanKey:
        try:
            return cls(model_hash=obj["model_hash"], input_shape=obj["input_shape"], dtype=obj["dtype"],
                       device=obj["device"], mode=obj.get("mode", "train"), grads=obj.get("grads", "none"))
        except KeyError as exc:
            raise InvalidKeyError(f"{exc.args[0]}: missing from the plan key") from None


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
    byte_fields = ("output_bytes", "saved_bytes", "forward_peak_bytes", "recompute_peak_bytes",
                   "backward_peak_bytes", "param_grad_bytes")
    for i, stage in enumerate(trace.stages):
        for name in byte_fields:
            if getattr(stage, name) > MAX_FIELD_BYTES:
                raise TraceRejectedError(f"stages[{i}].{name}: more than {MAX_FIELD_BYTES} bytes is not plausible")
        for name in ("forward_ms", "backward_ms"):
            value = getattr(stage, name)
            if value is not None and value > MAX_FIELD_MS:
                raise TraceRejectedError(f"stages[{i}].{name}: more than {MAX_FIELD_MS:g} ms is not plausible")
        _check_text(stage.name, f"stages[{i}].name")
        if stage.extra:
            _check_text(dict(stage.extra), f"stages[{i}]")
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
