"""The service's answers as the client reads them: each JSON body the HTTP client takes is checked against the
shape the client needs before any code reads a field.

Without this, a 200 with JSON of the wrong shape (another server on the port, a proxy's error page as JSON, a
service of another version, a hostile one) surfaced as ``AttributeError``/``KeyError``/``TypeError`` deep
in ``remat.client.checkpoint()``, and a training job died of it (issue 31). With it, such an answer is a
:class:`MalformedAnswerError` naming the field (``plan.num_stages: expected an integer, got 'many'``), which the
HTTP client turns into its one documented ``ServiceError``.

The shapes are the client's own record types, not copies of the service's response schemas
(service/schemas.py, which the client may not import): a plan is checked field by field against ``Plan``'s
annotations and then parsed by ``Plan.from_dict``; a plan key is what ``PlanKey.from_dict`` accepts; a
measurement and a zoo row are checked against ``Measurement``'s and ``ZooRow``'s annotations; a finished
job's result is what ``ModelReport.from_job`` reads. Answers without a client record type (a job, a zoo
batch, health) list the fields the client reads. Fields the client does not read are not checked, so a newer
service may add some.

Public API::

    plan_record(body) / trace_stored(body) / job(body) / zoo_batch(body) / health(body) -> dict  # body, checked
    MalformedAnswerError                      # a ValueError; the message starts with the field's path
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from remat.client.errors import RematError
from remat.client.job_state import JOB_ID_PATTERN, JobState
from remat.client.measurement import Measurement
from remat.client.plan import Plan
from remat.client.plan_key import PlanKey

__all__ = ["MalformedAnswerError", "health", "job", "plan_record", "trace_stored", "zoo_batch"]


class MalformedAnswerError(ValueError):
    """An answer that is not of the shape the client reads; the message starts with the field's path."""


Shape = Mapping[str, Any]
"""Field name → the type the client reads it as (``int``, ``str | None``, ``tuple[int, ...]``, an enum...)."""

_JOB_ID = re.compile(JOB_ID_PATTERN)

TRACE_INFO: Shape = {"torch_version": str | None, "device_name": str | None}
"""A plan record's ``trace``: what the client reads of it (the torch version its plan is keyed under, the
device it was measured on)."""

JOB: Shape = {"id": str, "state": JobState, "kind": str, "progress": float | None, "message": str | None,
              "error": str | None, "leader_id": str | None, "request": Mapping[str, Any],
              "result": Mapping[str, Any] | None}
"""``GET /v1/jobs/{id}``: the fields ``submit`` and ``status`` read; ``id`` and ``state`` are required."""

REQUEST: Shape = {"model": str, "batch_size": int, "input_shape": tuple[int, ...], "device": str, "grads": str,
                  "dtype": str, "mode": str, "model_kwargs": Mapping[str, Any] | None, "seq_len": int | None}
"""A job's ``request`` (``ModelRequest.to_dict``'s form), read when its result is shown."""

JOB_RESULT: Shape = {"key": Mapping[str, Any], "plans": list[Any], "frontier": list[Any], "reused": bool | None,
                     "device_name": str | None}
"""A finished profile job's ``result``, as ``ModelReport.from_job`` reads it."""

RESULT_ENTRY: Shape = {"plan": Mapping[str, Any], "measurement": Mapping[str, Any] | None}

ZOO_BATCH: Shape = {"id": str, "total": int, "done": bool, "progress": float, "models": list[Any]}
"""``POST /v1/zoo`` and ``GET /v1/zoo/{id}``: what ``zoo --server`` reads to follow a batch."""

ZOO_ENTRY: Shape = {"model": str, "job_id": str, "state": JobState, "row": Mapping[str, Any] | None}

HEALTH: Shape = {"status": str}


# --- checking a value against a type ------------------------------------------------------------------------

def _shown(value: Any) -> str:
    """A value as an error message shows it: its JSON type, and a short excerpt of a scalar."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _wanted(hint: Any) -> str:
    """A type as an error message names it."""
    if hint is type(None):
        return "null"
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_wanted(arg) for arg in typing.get_args(hint))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(str(member.value) for member in hint)
    origin = typing.get_origin(hint) or hint
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", tuple: "an array",
             list: "an array", Mapping: "an object", dict: "an object"}
    if origin in names:
        args = typing.get_args(hint)
        if origin in (tuple, list) and args and args[0] is not Any:
            return f"an array of {_wanted(args[0]).removeprefix('an ').removeprefix('a ')}s"
        return names[origin]
    raise TypeError(f"service_answers: no check for {hint!r}")  # a shape above names a type this module lacks


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value is of ``hint`` (an ``int`` fits a float; ``True`` is no integer)."""
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in typing.get_args(hint))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, str) and value in {member.value for member in hint}
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if (origin or hint) in (tuple, list, Sequence):
        args = [arg for arg in typing.get_args(hint) if arg is not Ellipsis]
        return isinstance(value, list) and all(_fits(item, args[0]) for item in value) if args else \
            isinstance(value, list)
    if (origin or hint) in (Mapping, dict):
        return isinstance(value, dict)
    raise TypeError(f"service_answers: no check for {hint!r}")


def _check(value: Any, hint: Any, where: str) -> None:
    if not _fits(value, hint):
        raise MalformedAnswerError(f"{where}: expected {_wanted(hint)}, got {_shown(value)}")


def _object(value: Any, where: str) -> dict[str, Any]:
    _check(value, Mapping[str, Any], where)
    return value


def _fields(value: Any, shape: Shape, where: str, *, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """``value`` as an object whose fields in ``shape`` are of their types; ``required`` ones present."""
    obj = _object(value, where)
    for name, hint in shape.items():
        if name in obj:
            _check(obj[name], hint, f"{where}.{name}")
        elif name in required:
            raise MalformedAnswerError(f"{where}.{name}: missing")
    return obj


@functools.cache
def _record_shape(cls: type, skip: frozenset[str] = frozenset()) -> tuple[Shape, tuple[str, ...]]:
    """A client dataclass as a shape: its annotated fields (less ``skip``) and those without a default."""
    hints = typing.get_type_hints(cls)
    shape = {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name not in skip}
    required = tuple(f.name for f in dataclasses.fields(cls) if f.name not in skip
                     and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    return shape, required


def _record(value: Any, cls: type, where: str, *, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    shape, required = _record_shape(cls, skip)
    return _fields(value, shape, where, required=required)


def _parsed(parse: Any, value: Any, where: str) -> Any:
    """``parse(value)``, its ``RematError`` (a plan's boundary out of range, a malformed key) as a malformed
    answer at ``where``."""
    try:
        return parse(value)
    except RematError as exc:
        raise MalformedAnswerError(f"{where}: {' '.join(str(exc).split())}") from None


# --- the client's records -----------------------------------------------------------------------------------

def _plan(value: Any, where: str) -> None:
    _parsed(Plan.from_dict, _record(value, Plan, where, skip=frozenset({"extra"})), where)


def _key(value: Any, where: str) -> None:
    _parsed(PlanKey.from_dict, _object(value, where), where)


def _measurement(value: Any, where: str) -> None:
    # id and created_at are the database's; Measurement.from_dict leaves them out.
    _record(value, Measurement, where, skip=frozenset({"id", "created_at"}))


def plan_record(body: Any) -> dict[str, Any]:
    """``GET /v1/plans/{hash}``: ``plan`` (a ``Plan``), ``key`` (a ``PlanKey``), ``trace`` (``TRACE_INFO``)
    and ``measurements`` (``Measurement``s, newest first)."""
    record = _object(body, "answer")
    for name, check in (("plan", _plan), ("key", _key)):
        if name not in record:
            raise MalformedAnswerError(f"{name}: missing (a plan record has its plan and its key)")
        check(record[name], name)
    if record.get("trace") is not None:
        _fields(record["trace"], TRACE_INFO, "trace")
    if record.get("measurements") is not None:
        _check(record["measurements"], list[Any], "measurements")
        for i, measurement in enumerate(record["measurements"]):
            _measurement(measurement, f"measurements[{i}]")
    return record


def trace_stored(body: Any) -> dict[str, Any]:
    """``POST /v1/traces``: ``key``, ``created`` and the plans the service made (``plans``, ``frontier``)."""
    answer = _fields(body, {"created": bool, "trace_id": int, "plans": list[Any], "frontier": list[Any]},
                     "answer", required=("created",))
    if "key" not in answer:
        raise MalformedAnswerError("key: missing")
    _key(answer["key"], "key")
    for name in ("plans", "frontier"):
        for i, plan in enumerate(answer.get(name) or ()):
            _plan(plan, f"{name}[{i}]")
    return answer


def job(body: Any) -> dict[str, Any]:
    """A job (``POST /v1/jobs``, ``GET /v1/jobs/{id}``): ``JOB``'s fields; a succeeded profile job's
    ``request`` and ``result`` as ``ModelReport.from_job`` reads them."""
    answer = _fields(body, JOB, "answer", required=("id", "state"))
    if not _JOB_ID.fullmatch(answer["id"]):
        raise MalformedAnswerError(f"id: expected a job id (a UUID), got {_shown(answer['id'])}")
    if answer["state"] == JobState.SUCCEEDED and answer.get("kind", "profile") == "profile" and answer.get("result"):
        from remat.client.report import ModelReport

        _fields(answer.get("request"), REQUEST, "request", required=("model", "batch_size", "input_shape"))
        result = _fields(answer["result"], JOB_RESULT, "result", required=("key", "plans"))
        for name in ("plans", "frontier"):
            for i, entry in enumerate(result.get(name) or ()):
                where = f"result.{name}[{i}]"
                _fields(entry, RESULT_ENTRY, where, required=("plan",))
                _plan(entry["plan"], f"{where}.plan")
                if entry.get("measurement") is not None:
                    _measurement(entry["measurement"], f"{where}.measurement")
        _parsed(ModelReport.from_job, answer, "result")
    return answer


def zoo_batch(body: Any) -> dict[str, Any]:
    """A zoo batch (``POST /v1/zoo``, ``GET /v1/zoo/{id}``): ``ZOO_BATCH``'s fields, each model's
    ``ZOO_ENTRY`` and its row a ``ZooRow``."""
    from remat.client.zoo_batch import ZooRow

    answer = _fields(body, ZOO_BATCH, "answer", required=tuple(ZOO_BATCH))
    if not _JOB_ID.fullmatch(answer["id"]):
        raise MalformedAnswerError(f"id: expected a batch id (a UUID), got {_shown(answer['id'])}")
    for i, entry in enumerate(answer["models"]):
        where = f"models[{i}]"
        _fields(entry, ZOO_ENTRY, where, required=tuple(ZOO_ENTRY))
        if entry["row"] is not None:
            _record(entry["row"], ZooRow, f"{where}.row")
    return answer


def health(body: Any) -> dict[str, Any]:
    """``GET /healthz``: an object with its ``status``."""
    return _fields(body, HEALTH, "answer", required=("status",))
