"""The plan key: everything a measured plan depends on besides the algorithm and the budget.

One definition for the whole product: the client computes it from a model, the service stores and looks plans
up by it (its database columns, API schemas and cache keys derive from it), the worker keys what it profiles
with it. A plan measured for one (architecture, input shape, precision, mode, gradient convention, device
class, torch version) says nothing reliable about another: activation sizes scale with the input, the gradient
convention decides what checkpointing buys (docs/cost-model.md, "The `linear` plan against the others"),
autocast changes the peak by up to 80% (docs/cost-model.md), and fx graphs may change between torch releases.
The field names are those of the trace metadata, so a trace's metadata dict can be read with
``PlanKey.from_dict``.

Importing this module imports no torch: the torch version comes from the package metadata, and
a model's key is computed by the stage-graph family (``remat.client.graph.built_model.key_for_model``),
which hashes the model: this vocabulary never reaches into model code.

Public API::

    PlanKey(model_hash, input_shape, dtype="float32", mode="train", grads="none", device="cpu",
            torch_version=<the installed torch's major.minor>)
    PlanKey.from_trace(trace) / key.to_dict() / PlanKey.from_dict(obj)
    key.describe(exclude=()) -> "model_hash 3f2ab8c01d9e…, input_shape [32, 3, 224, 224], dtype float32, …"
    key.describe_mismatch(other, fields=None) -> str | None
    current_torch_version() -> "2.15";  normalize_torch_version("2.15.0+cu132") -> "2.15"
"""

from __future__ import annotations

import importlib.metadata
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from remat.client.errors import InvalidKeyError, PlanError
from remat.client.precision import normalize_precision
from remat.client.trace import GRAD_CONVENTIONS, MODES, Trace, content_sha256

if TYPE_CHECKING:
    pass

__all__ = ["KEY_FIELDS", "LABEL", "MAX_DIM", "MAX_DIMS", "MAX_INPUTS_CHARS", "MAX_NUMEL", "MODEL_HASH_PATTERN",
           "UNKNOWN", "UNRECORDED", "PlanKey", "content_sha256", "current_torch_version", "normalize_device",
           "normalize_dtype", "normalize_inputs", "normalize_torch_version", "parse_input_shape"]

UNKNOWN = "unknown"
"""dtype, device class or torch version of a trace that does not say: still a key, never one a profiler
writes. As a torch version in a lookup it matches any version."""
MAX_DIMS = 8
MAX_DIM = 2**31 - 1
MAX_NUMEL = 2**40
MODEL_HASH_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._:+-]{0,127}"
DEVICE_PATTERN = r"[A-Za-z][A-Za-z0-9_]{0,31}(:[0-9]{1,4})?"
_HASH_RE = re.compile(MODEL_HASH_PATTERN)
_DEVICE_RE = re.compile(DEVICE_PATTERN)


def normalize_torch_version(version: object, field: str = "torch_version") -> str:
    """``"2.15.0+cu132"`` → ``"2.15"`` (plans are keyed on major.minor); ``unknown`` stays."""
    text = str(version).strip()
    if text == UNKNOWN:
        return UNKNOWN
    parts = text.split("+")[0].split(".")
    minor = "".join(ch for ch in parts[1] if ch.isdigit()) if len(parts) >= 2 else ""
    if len(parts) < 2 or not parts[0].isdigit() or not minor:
        raise InvalidKeyError(f"{field}: expected MAJOR.MINOR[.PATCH], got {version!r}")
    return f"{int(parts[0])}.{int(minor)}"


def current_torch_version() -> str:
    """The installed torch's major.minor, from the package metadata (reading it does not import torch)."""
    return normalize_torch_version(importlib.metadata.version("torch"))


def normalize_device(value: object, field: str = "device") -> str:
    """Reduce a device to its class: ``torch.device("cuda:1")``, ``"cuda:1"`` and ``"CUDA"`` become ``cuda``."""
    text = str(value).strip()
    if text == UNKNOWN:
        return UNKNOWN
    if not _DEVICE_RE.fullmatch(text):
        raise InvalidKeyError(f"{field}: must be a device class such as cpu or cuda, got {value!r}")
    return text.split(":", 1)[0].lower()


def normalize_dtype(value: object) -> str:
    """A precision (remat.client.precision) or ``unknown``; InvalidKeyError naming the field otherwise."""
    if value == UNKNOWN:
        return UNKNOWN
    try:
        return normalize_precision(value)
    except PlanError as exc:
        raise InvalidKeyError(str(exc)) from None


def parse_input_shape(value: object, field: str = "input_shape") -> tuple[int, ...]:
    """``"32,3,224,224"``, ``[32, 3, 224, 224]`` or a ``torch.Size``; an empty string or list is a scalar."""
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


MAX_INPUTS_CHARS = 2000
"""Longest call signature a key holds (``ModelCall`` refuses longer ones with the reason)."""
_INPUTS_RE = re.compile(r"[ -~]*")


def normalize_inputs(value: object, field: str = "inputs") -> str:
    """A call signature: printable ASCII, at most ``MAX_INPUTS_CHARS`` characters ("" for one tensor)."""
    if not isinstance(value, str):
        raise InvalidKeyError(f"{field}: must be a call signature (text), got {value!r}")
    if len(value) > MAX_INPUTS_CHARS or not _INPUTS_RE.fullmatch(value):
        raise InvalidKeyError(f"{field}: must be at most {MAX_INPUTS_CHARS} printable ASCII characters")
    return value


def _check_choice(value: object, choices: Sequence[str], field: str) -> str:
    if value not in choices:
        raise InvalidKeyError(f"{field}: must be one of {', '.join(choices)}, got {value!r}")
    return str(value)


UNRECORDED = "unrecorded"
"""Field metadata: what a trace that does not record the field means by it (default: the field's default)."""
LABEL = "label"
"""Field metadata: the field's name in ``describe``'s messages (default: the field's name)."""


@dataclass(frozen=True, slots=True)
class PlanKey:
    """What a plan is valid for. Two keys match when every field is equal (in a lookup, a torch_version of
    ``unknown`` matches any version).

    The fields are the one list of the key's components: the service's schemas, table columns, query
    parameters and cache keys, and the client's lookups, are derived from ``fields(PlanKey)``. A new field
    needs its bounds in service/keys.py, its columns in service/models.py and a migration.
    """

    model_hash: str
    """``hashing.architecture_hash`` of the model (hex sha256), or ``trace:<digest>`` for a hand-written trace."""
    input_shape: tuple[int, ...] = field(metadata={UNRECORDED: ()})
    """Full input shape, batch dimension included (of the first tensor input, for a call of several)."""
    inputs: str = field(default="", metadata={UNRECORDED: ""})
    """The training call's signature (``remat.client.graph.model_call.ModelCall``): every input's name,
    dtype and shape and every constant the call passes (``input_ids: int64[2, 256]; use_cache=False``); ""
    for a call of one positional tensor, which ``input_shape`` and ``dtype`` describe."""
    dtype: str = field(default="float32", metadata={UNRECORDED: UNKNOWN})
    """The step's precision (``remat.client.precision``): ``float32``, ``bfloat16``… or ``autocast_bfloat16``."""
    mode: str = "train"
    """``train`` or ``eval``: graphs (aux heads) and memory differ between the two."""
    grads: str = "none"
    """``none``: gradients set to None between steps (``zero_grad(set_to_none=True)``, PyTorch's default);
    ``kept``: gradients stay allocated across steps."""
    device: str = field(default="cpu", metadata={UNRECORDED: UNKNOWN})
    """Device class: ``cpu`` or ``cuda``."""
    torch_version: str = field(default_factory=current_torch_version, metadata={UNRECORDED: UNKNOWN, LABEL: "torch"})
    """torch major.minor the trace was made with (``unknown`` when a trace does not say)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model_hash, str) or not _HASH_RE.fullmatch(self.model_hash):
            raise InvalidKeyError(f"model_hash: must be 1-128 characters of letters, digits and ._:+- starting "
                                  f"with a letter or digit, got {self.model_hash!r}")
        object.__setattr__(self, "input_shape", parse_input_shape(self.input_shape))
        object.__setattr__(self, "inputs", normalize_inputs(self.inputs))
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        _check_choice(self.mode, MODES, "mode")
        _check_choice(self.grads, GRAD_CONVENTIONS, "grads")
        object.__setattr__(self, "device", normalize_device(self.device))
        object.__setattr__(self, "torch_version", normalize_torch_version(self.torch_version))

    @property
    def input_shape_text(self) -> str:
        """The shape as stored and as passed in URLs: ``32,3,224,224``."""
        return ",".join(map(str, self.input_shape))

    @classmethod
    def from_trace(cls, trace: Trace, *, content_hash: str | None = None) -> PlanKey:
        """The key a trace's plans are stored under.

        A trace without ``model_hash`` (written by hand) is keyed by its content digest, ``trace:<hex>``;
        missing dtype, device and torch version read as ``unknown``, missing mode and grads as the defaults
        (each field's ``UNRECORDED`` metadata, else its default).
        """
        meta = trace.metadata
        values = {f.name: _unrecorded(f) if meta.get(f.name) is None else meta[f.name]  # absent or null
                  for f in fields(cls) if f.name != "model_hash"}
        model_hash = meta.get("model_hash") or f"trace:{(content_hash or content_sha256(trace))[:40]}"
        return cls(model_hash=model_hash, **values)

    def to_dict(self) -> dict[str, Any]:
        """JSON form, in field order; the names are the trace metadata's."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> PlanKey:
        """Parse ``to_dict``'s form (extra keys, e.g. the rest of a trace's metadata, are ignored; a missing
        torch_version means the installed one)."""
        if not isinstance(obj, Mapping):
            raise InvalidKeyError(f"plan key: must be an object, got {type(obj).__name__}")
        missing = [name for name in ("model_hash", "input_shape") if name not in obj]
        if missing:
            raise InvalidKeyError(f"plan key: field {missing[0]!r} is missing")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in obj.items() if k in known and v is not None})

    def describe(self, *, exclude: Iterable[str] = ()) -> str:
        """One line naming the key, short enough for an error message (the hash is cut to 12 characters):
        ``model_hash 3f2ab8c01d9e…, input_shape [32, 3, 224, 224], dtype float32, mode train, grads none,
        device cpu, torch 2.15``; ``exclude`` leaves out fields a message names its own way."""
        skipped = set(exclude) | ({"inputs"} if not self.inputs else set())
        return ", ".join(f"{f.metadata.get(LABEL, f.name)} {self._shown(f.name)}" for f in fields(self)
                         if f.name not in skipped)

    def describe_mismatch(self, other: PlanKey, fields: Iterable[str] | None = None) -> str | None:
        """None when ``other`` matches on ``fields`` (all by default), else one line naming each difference
        as ``field: <self's value> vs <other's value>``."""
        names = list(fields) if fields is not None else list(KEY_FIELDS)
        diffs = [f"{name}: {self._shown(name)} vs {other._shown(name)}" for name in names
                 if getattr(self, name) != getattr(other, name)]
        return "; ".join(diffs) or None

    def _shown(self, name: str) -> Any:
        """A field's value as messages show it: the hash cut to 12 characters, the shape as a list."""
        value = getattr(self, name)
        return f"{value[:12]}…" if name == "model_hash" else _plain(value)


def _plain(value: Any) -> Any:
    """A field's JSON value: a shape (tuple) as a list."""
    return list(value) if isinstance(value, tuple) else value


def _unrecorded(f: Field[Any]) -> Any:
    """What a trace that does not record field ``f`` means by it: its ``UNRECORDED`` metadata, else its default."""
    if UNRECORDED in f.metadata:
        return f.metadata[UNRECORDED]
    return f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]


KEY_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(PlanKey))
