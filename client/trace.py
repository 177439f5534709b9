"""The ``remat-trace/1`` format: one validated, immutable in-memory form of a layer memory trace.

A trace describes a network cut into a chain of stages 1..n (see docs/cost-model.md for what each field
means to the planners) and, optionally, its op graph (``graph``: every tensor the model computes as a
vertex, for planners that cut inside blocks; docs/algorithms.md, ``acg``). It is the one contract between
profilers, planners, the plan database and users who write traces by hand, so it is loaded and validated
here and nowhere else.

Validation is hand-written rather than delegated to a schema library on purpose: traces of 10^6 stages must
load in well under a second, and every error must be one line that names the field (``stages[3].output_bytes``).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from remat.client import wire_json
from remat.client.errors import TraceFormatError
from remat.client.user_files import FileTooLargeError, read_limited

TRACE_FORMAT = "remat-trace/1"
MAX_TRACE_FILE_BYTES = 64 * 2**20
"""The largest trace file ``load_trace`` reads (``plan --trace``, ``evaluate``): a 10^5-stage trace with every
field, indented as ``remat-client trace`` writes it, is about 55 MB, and the service takes bodies of 16 MiB
(``REMAT_MAX_BODY_BYTES``) and 20,000 stages; a larger file is a mistake, refused before it is read into
memory (issue 31: a 20 GB file was read until the OOM killer ended the command)."""

#: Per-stage integer byte fields a profiler may add; a missing one reads as 0 (docs/cost-model.md).
OPTIONAL_STAGE_BYTES = (
    "forward_peak_bytes",
    "forward_peak_dropped_bytes",
    "recompute_peak_bytes",
    "backward_peak_bytes",
    "recomputed_backward_peak_bytes",
    "param_grad_bytes",
    "cast_bytes",
    "cast_unsaved_bytes",
)
OPTIONAL_STAGE_BOOLS = ("saves_input", "saves_output", "saves_nothing")
OPTIONAL_STAGE_MS = ("forward_ms", "backward_ms", "recompute_ms")
#: Every field of a stage, in the order a table of stages lists them (the plan database's columns).
STAGE_FIELDS = ("name", "output_bytes", "saved_bytes", *OPTIONAL_STAGE_BYTES, *OPTIONAL_STAGE_BOOLS,
                *OPTIONAL_STAGE_MS)
_STAGE_KNOWN = set(STAGE_FIELDS)

#: Optional top-level metadata and the JSON type each must have.
METADATA_TYPES: dict[str, type | tuple[type, ...]] = {
    "model": str,
    "model_hash": str,
    "input_shape": list,
    "inputs": str,
    "dtype": str,
    "device": str,
    "device_name": str,
    "torch_version": str,
    "grads": str,
    "mode": str,
    "batch_size": int,
    "side_bytes": int,
    "side_unsaved_bytes": int,
    "side_by_stage": list,
    "side_unsaved_by_stage": list,
    "side_values": list,
    "checkpoint_ms": (int, float),
    "timing": dict,
}
GRAD_CONVENTIONS = ("none", "kept")
MODES = ("train", "eval")


@dataclass(kw_only=True, slots=True, frozen=True)
class Stage:
    """One stage of the chain: the ops between two consecutive checkpoint boundaries."""

    name: str
    """Human-readable label (module path or fx node names)."""
    output_bytes: int
    """d_i: bytes of the stage's output tensor x_i, the activation handed to the next stage."""
    saved_bytes: int
    """e_i: distinct storages autograd keeps for this stage's backward, parameters and buffers excluded,
    and excluding the stage's own input and output (those are flagged by ``saves_input``/``saves_output``
    so that a storage shared by two stages is counted once)."""
    saves_input: bool = False
    """Autograd keeps the stage's input x_{i-1} for its backward."""
    saves_output: bool = False
    """Autograd keeps the stage's output x_i for its backward."""
    saves_nothing: bool = False
    """Autograd keeps no tensor at all for this stage's backward, parameters and buffers included (views,
    permutes, ``cat``, adding a constant). A checkpointed segment made only of such stages has nothing to
    recompute and no checkpoint frame survives its forward, so its input is not kept (docs/cost-model.md).
    Implies ``saved_bytes`` 0 and neither ``saves_input`` nor ``saves_output``."""
    forward_peak_bytes: int = 0
    """F_i: peak bytes above what was alive before the stage (its input included) while it runs forward
    with grad enabled: its saved tensors, output and temporaries. 0 when not profiled."""
    forward_peak_dropped_bytes: int = 0
    """F°_i: like F_i, but with autograd keeping none of the stage's saved tensors, as in the first forward
    of a checkpointed segment: its output, temporaries and (autocast) parameter copies. 0 when not
    profiled (F_i is used instead)."""
    recompute_peak_bytes: int = 0
    """F'_i: like F_i but only up to the stage's last saved tensor, where a non-reentrant checkpoint's
    recomputation stops early. 0 when not profiled."""
    backward_peak_bytes: int = 0
    """B_i: peak, during the stage's backward, of the bytes that belong to the stage: its saved tensors
    other than its input, its output gradient, the input gradient it makes, parameter gradients born in it
    and temporaries. 0 when not profiled."""
    recomputed_backward_peak_bytes: int = 0
    """B°_i: like B_i, for the stage run under a non-reentrant checkpoint, from the end of its recompute on.
    A recomputed node drops its unpacked saved tensors when it returns, before the engine checks (sums
    broadcast gradients, casts dtypes) its outputs; a plain node keeps them until after. 0 when not
    profiled (B_i is used instead)."""
    param_grad_bytes: int = 0
    """G_i: bytes of parameter gradients born during this stage's backward (gradients set to None between
    steps); 0 when gradients are kept allocated."""
    cast_bytes: int = 0
    """W_i (autocast precisions): bytes of the lower-precision parameter copies autocast makes at their first
    use in this stage. Autocast's cast cache keeps them until the forward ends, also in checkpointed
    stages whose saved tensors are dropped. 0 without autocast."""
    cast_unsaved_bytes: int = 0
    """The part of ``cast_bytes`` that no stage saves for backward (alive only in the forward's cache)."""
    forward_ms: float | None = None
    """Time of the stage's forward with grad enabled, timed inside a whole forward pass (the context a
    recompute runs in): the least of several rounds. None when not profiled."""
    backward_ms: float | None = None
    recompute_ms: float | None = None
    """What re-running this stage under a non-reentrant checkpoint adds to a training step: its recompute in
    backward and the saving and unpacking of its tensors through the checkpoint's hooks, measured in real
    steps (NOTE [ timing a plan ] in remat.worker.profilers.step_timing). None when not measured; then
    ``forward_ms`` stands in for it."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Fields a profiler recorded that the planners do not use; kept so that a round trip loses nothing."""

    def to_dict(self) -> dict[str, Any]:
        """JSON form, omitting optional fields at their defaults."""
        out: dict[str, Any] = {"name": self.name, "output_bytes": self.output_bytes,
                               "saved_bytes": self.saved_bytes}
        for key in OPTIONAL_STAGE_BOOLS + OPTIONAL_STAGE_BYTES:
            value = getattr(self, key)
            if value:
                out[key] = value
        for key in OPTIONAL_STAGE_MS:
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        out.update(self.extra)
        return out


@dataclass(kw_only=True, slots=True, frozen=True)
class GraphVertex:
    """One vertex of a trace's op graph: a group of ops that create one set of storages."""

    name: str
    bytes: int
    """Bytes of the storages the vertex's ops create: what keeping the vertex costs (``op_graph.weights``)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Fields a profiler recorded that the planners do not use; kept so that a round trip loses nothing."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "bytes": self.bytes, **self.extra}


@dataclass(kw_only=True, slots=True, frozen=True)
class TraceGraph:
    """The op graph of the traced model (``remat.client.graph.op_graph.OpGraph`` without the model).

    Vertices are numbered in topological order: vertex 0 is the input, the last vertex the output (a weight-0
    vertex joining several outputs), every edge ``(u, v)`` has u < v, and every vertex lies on a path from
    the first to the last. A graph plan names the vertices it recomputes (``Plan.dropped_vertices``).
    """

    vertices: tuple[GraphVertex, ...]
    edges: tuple[tuple[int, int], ...]

    @property
    def num_vertices(self) -> int:
        return len(self.vertices)

    @property
    def weights(self) -> list[int]:
        return [v.bytes for v in self.vertices]

    def to_dict(self) -> dict[str, Any]:
        return {"vertices": [v.to_dict() for v in self.vertices], "edges": [list(e) for e in self.edges]}


MAX_SIDE_VALUES = 4096
"""The most side-value storages a trace may list (``side_values``): a transformer has a handful (masks,
position tables, an encoder's output), whatever its depth."""


@dataclass(kw_only=True, slots=True, frozen=True)
class SideValue:
    """One side value's storage (metadata ``side_values``; docs/cost-model.md, "Side values"): what decides
    how long it lives in a step with a plan applied, which the cost model needs plan by plan."""

    stage: int
    """The stage that makes it (1-based)."""
    bytes: int
    """Its storage's bytes (what ``side_by_stage`` books for it)."""
    saved_by: tuple[int, ...] = ()
    """Stages that save it for backward (the maker included when it does): a stage of the last segment holds it
    until its own backward, a checkpointed one only while its recompute's copy waits for that backward."""
    grad_bytes: int = 0
    """Bytes of its gradient, when a later stage's backward sends it one: that buffer lives from the first such
    backward until the maker's."""
    grad_from: tuple[int, ...] = ()
    """The stages whose backward sends it a gradient."""

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "bytes": self.bytes, "saved_by": list(self.saved_by),
                "grad_bytes": self.grad_bytes, "grad_from": list(self.grad_from)}


def _parse_side_values(given: Any, n: int) -> tuple[SideValue, ...]:
    """``side_values`` checked: each entry's stages within 1..n, its savers and gradient senders at or after
    its maker (the maker's own use included), byte counts non-negative integers."""
    if len(given) > MAX_SIDE_VALUES:
        raise TraceFormatError(f"side_values: at most {MAX_SIDE_VALUES} entries, got {len(given)}")
    out = []
    for k, entry in enumerate(given):
        where = f"side_values[{k}]"
        if not isinstance(entry, Mapping):
            raise TraceFormatError(f"{where}: must be an object, got {entry!r}")
        unknown = set(entry) - {"stage", "bytes", "saved_by", "grad_bytes", "grad_from"}
        if unknown:
            raise TraceFormatError(f"{where}.{sorted(unknown)[0]}: unknown field")
        stage = entry.get("stage")
        if isinstance(stage, bool) or not isinstance(stage, int) or not 1 <= stage <= n:
            raise TraceFormatError(f"{where}.stage: must be a stage number in 1..{n}, got {stage!r}")
        sizes = {}
        for name in ("bytes", "grad_bytes"):
            value = entry.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2**50:
                raise TraceFormatError(f"{where}.{name}: must be a non-negative integer, got {value!r}")
            sizes[name] = value
        lists = {}
        for name, first in (("saved_by", stage), ("grad_from", stage + 1)):
            value = entry.get(name, [])
            if (not isinstance(value, list) or len(value) > n
                    or any(isinstance(i, bool) or not isinstance(i, int) or not first <= i <= n for i in value)):
                raise TraceFormatError(f"{where}.{name}: must be a list of stage numbers in {first}..{n}")
            lists[name] = tuple(sorted(set(value)))
        if sizes["grad_bytes"] and not lists["grad_from"]:
            raise TraceFormatError(f"{where}.grad_bytes: a gradient needs the stages that send it (grad_from)")
        out.append(SideValue(stage=stage, bytes=sizes["bytes"], saved_by=lists["saved_by"],
                             grad_bytes=sizes["grad_bytes"], grad_from=lists["grad_from"]))
    return tuple(out)


@dataclass(kw_only=True, slots=True, frozen=True)
class Trace:
    """A whole ``remat-trace/1`` trace: the stages plus metadata about how they were measured."""

    input_bytes: int
    """d_0: bytes of the network input (a constant of every plan)."""
    stages: tuple[Stage, ...]
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """Optional top-level fields: model, model_hash, input_shape, dtype, device, torch_version, grads, mode…"""
    graph: TraceGraph | None = None
    """The model's op graph, when the profiler recorded it (``acg`` plans on it; the chain planners ignore it)."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def side_bytes(self) -> int:
        """Bytes of the side values (metadata ``side_bytes``): tensors the forward makes once and every later
        stage reads besides the boundary (attention masks, an encoder's output), alive to the end of
        backward whatever is checkpointed; a constant of every plan (docs/cost-model.md, "Side values")."""
        return int(self.metadata.get("side_bytes") or 0)

    @property
    def side_by_stage(self) -> tuple[int, ...]:
        """Bytes of the side values each stage makes (metadata ``side_by_stage``); a trace that gives only
        ``side_bytes`` has them made by the first stage."""
        given = self.metadata.get("side_by_stage")
        if given is not None:
            return tuple(int(b) for b in given)
        return (self.side_bytes, *([0] * (self.num_stages - 1)))

    @property
    def side_unsaved_by_stage(self) -> tuple[int, ...]:
        """The part of :attr:`side_by_stage` no stage saves (metadata ``side_unsaved_by_stage``); a trace that
        gives only ``side_unsaved_bytes`` has them made by the first stage."""
        given = self.metadata.get("side_unsaved_by_stage")
        if given is not None:
            return tuple(int(b) for b in given)
        return (self.side_unsaved_bytes, *([0] * (self.num_stages - 1)))

    @property
    def side_unsaved_bytes(self) -> int:
        """The part of :attr:`side_bytes` no stage saves for backward (metadata ``side_unsaved_bytes``): gone
        once the forward returns, unless a checkpointed segment holds it as an input for its recompute."""
        return int(self.metadata.get("side_unsaved_bytes") or 0)

    @property
    def side_values(self) -> tuple[SideValue, ...]:
        """Each side value's storage with its makers, savers and gradient (metadata ``side_values``); empty for
        a trace that gives only the per-stage sums, which the cost model then prices as resident."""
        return _parse_side_values(self.metadata.get("side_values") or [], self.num_stages)

    @property
    def checkpoint_ms(self) -> float:
        """Fixed time one checkpointed segment adds to a step whatever it re-runs (metadata ``checkpoint_ms``:
        the checkpoint's frame, RNG and buffer bookkeeping, its early stop); 0 when not measured."""
        value = self.metadata.get("checkpoint_ms")
        return float(value) if value is not None else 0.0

    @property
    def has_times(self) -> bool:
        """True when every stage has a forward time, so recompute time can be estimated."""
        return all(s.forward_ms is not None for s in self.stages)

    def column(self, name: str) -> list[Any]:
        """The values of one stage field, in stage order (planners work on plain lists)."""
        return [getattr(s, name) for s in self.stages]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": TRACE_FORMAT, **self.metadata, "input_bytes": self.input_bytes}
        out["stages"] = [s.to_dict() for s in self.stages]
        if self.graph is not None:
            out["graph"] = self.graph.to_dict()
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _nonneg_int(obj: Mapping[str, Any], key: str, where: str, *, required: bool) -> int:
    if key not in obj:
        if required:
            raise TraceFormatError(f"{where}{key}: missing (an integer number of bytes ≥ 0 is required)")
        return 0
    value = obj[key]
    if not _is_int(value):
        raise TraceFormatError(f"{where}{key}: must be an integer number of bytes, got {value!r}")
    if value < 0:
        raise TraceFormatError(f"{where}{key}: must be ≥ 0, got {value}")
    return value


def _named_object(obj: Any, label: str) -> str:
    """The ``name`` of an object entry (a stage, a graph vertex), or a one-line error naming ``label``."""
    if not isinstance(obj, Mapping):
        raise TraceFormatError(f"{label}: must be an object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str):
        raise TraceFormatError(f"{label}.name: missing or not a string")
    return name


def _parse_stage(obj: Any, index: int) -> Stage:
    where = f"stages[{index}]."
    name = _named_object(obj, f"stages[{index}]")
    kwargs: dict[str, Any] = {
        "name": name,
        "output_bytes": _nonneg_int(obj, "output_bytes", where, required=True),
        "saved_bytes": _nonneg_int(obj, "saved_bytes", where, required=True),
    }
    for key in OPTIONAL_STAGE_BYTES:
        kwargs[key] = _nonneg_int(obj, key, where, required=False)
    for key in OPTIONAL_STAGE_BOOLS:
        value = obj.get(key, False)
        if not isinstance(value, bool):
            raise TraceFormatError(f"{where}{key}: must be true or false, got {value!r}")
        kwargs[key] = value
    for key in OPTIONAL_STAGE_MS:
        value = obj.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise TraceFormatError(f"{where}{key}: must be a number of milliseconds ≥ 0, got {value!r}")
        kwargs[key] = float(value)
    if kwargs["cast_unsaved_bytes"] > kwargs["cast_bytes"]:
        raise TraceFormatError(f"{where}cast_unsaved_bytes: must be ≤ cast_bytes ({kwargs['cast_bytes']}), "
                               f"got {kwargs['cast_unsaved_bytes']}")
    if kwargs["saves_nothing"]:
        for key in ("saved_bytes", "saves_input", "saves_output"):
            if kwargs[key]:
                raise TraceFormatError(f"{where}saves_nothing: true contradicts {key} = {kwargs[key]!r}")
    extra = {k: v for k, v in obj.items() if k not in _STAGE_KNOWN}
    return Stage(**kwargs, extra=extra)


def _parse_vertex(obj: Any, index: int) -> GraphVertex:
    where = f"graph.vertices[{index}]."
    name = _named_object(obj, f"graph.vertices[{index}]")
    nbytes = _nonneg_int(obj, "bytes", where, required=True)
    return GraphVertex(name=name, bytes=nbytes, extra={k: v for k, v in obj.items() if k not in ("name", "bytes")})


def _parse_graph(obj: Any) -> TraceGraph:
    """Validate the optional ``graph`` field: the rules of :class:`TraceGraph`, each broken one named."""
    if not isinstance(obj, Mapping):
        raise TraceFormatError(f"graph: must be an object with vertices and edges, got {type(obj).__name__}")
    unknown = sorted(set(obj) - {"vertices", "edges"})
    if unknown:
        raise TraceFormatError(f"graph.{unknown[0]}: unknown field (a graph has vertices and edges)")
    vertices_obj, edges_obj = obj.get("vertices"), obj.get("edges")
    if not isinstance(vertices_obj, Sequence) or isinstance(vertices_obj, str):
        raise TraceFormatError("graph.vertices: missing or not a list")
    if len(vertices_obj) < 2:
        raise TraceFormatError(f"graph.vertices: needs at least 2 (the input and the output), got {len(vertices_obj)}")
    if not isinstance(edges_obj, Sequence) or isinstance(edges_obj, str):
        raise TraceFormatError("graph.edges: missing or not a list")
    vertices = tuple(_parse_vertex(v, i) for i, v in enumerate(vertices_obj))
    n = len(vertices)
    edges: list[tuple[int, int]] = []
    has_in, has_out = [False] * n, [False] * n
    seen: set[tuple[int, int]] = set()
    for i, edge in enumerate(edges_obj):
        if (not isinstance(edge, Sequence) or isinstance(edge, str) or len(edge) != 2
                or not all(_is_int(x) for x in edge)):
            raise TraceFormatError(f"graph.edges[{i}]: must be a pair of vertex numbers [u, v], got {edge!r}")
        u, v = edge
        if not 0 <= u < v < n:
            raise TraceFormatError(f"graph.edges[{i}]: [{u}, {v}] must satisfy 0 ≤ u < v < {n} (vertices are "
                                   "numbered in topological order)")
        if (u, v) in seen:
            raise TraceFormatError(f"graph.edges[{i}]: [{u}, {v}] is listed twice")
        seen.add((u, v))
        edges.append((u, v))
        has_out[u] = has_in[v] = True
    for v in range(1, n):
        if not has_in[v]:
            raise TraceFormatError(f"graph.vertices[{v}]: no edge enters it (vertex 0, the input, must be the "
                                   "only source)")
    for v in range(n - 1):
        if not has_out[v]:
            raise TraceFormatError(f"graph.vertices[{v}]: no edge leaves it (vertex {n - 1}, the output, must be "
                                   "the only sink)")
    return TraceGraph(vertices=vertices, edges=tuple(sorted(edges)))


def parse_trace(obj: Any) -> Trace:
    """Validate a decoded JSON object as ``remat-trace/1``.

    Raises:
        TraceFormatError: with one line naming the first offending field.
    """
    if not isinstance(obj, Mapping):
        raise TraceFormatError(f"trace: must be a JSON object, got {type(obj).__name__}")
    fmt = obj.get("format")
    if fmt != TRACE_FORMAT:
        raise TraceFormatError(f"format: must be {TRACE_FORMAT!r}, got {fmt!r}")
    input_bytes = _nonneg_int(obj, "input_bytes", "", required=True)
    stages_obj = obj.get("stages")
    if not isinstance(stages_obj, Sequence) or isinstance(stages_obj, str):
        raise TraceFormatError("stages: missing or not a list")
    if not stages_obj:
        raise TraceFormatError("stages: must hold at least one stage, got none")
    stages = tuple(_parse_stage(s, i) for i, s in enumerate(stages_obj))
    metadata: dict[str, Any] = {}
    for key, value in obj.items():
        if key in ("format", "input_bytes", "stages", "graph"):
            continue
        expected = METADATA_TYPES.get(key)
        if expected is not None and value is not None and not isinstance(value, expected):
            raise TraceFormatError(f"{key}: must be of type {getattr(expected, '__name__', expected)}, "
                                   f"got {value!r}")
        metadata[key] = value
    for name in ("side_bytes", "side_unsaved_bytes"):
        if metadata.get(name) is not None:
            _nonneg_int(metadata, name, "", required=True)
    checkpoint_ms = metadata.get("checkpoint_ms")
    if checkpoint_ms is not None and (isinstance(checkpoint_ms, bool) or not math.isfinite(checkpoint_ms)
                                      or checkpoint_ms < 0):
        raise TraceFormatError(f"checkpoint_ms: must be a number of milliseconds ≥ 0, got {checkpoint_ms!r}")
    if int(metadata.get("side_unsaved_bytes") or 0) > int(metadata.get("side_bytes") or 0):
        raise TraceFormatError("side_unsaved_bytes: must not exceed side_bytes")
    for name, total in (("side_by_stage", "side_bytes"), ("side_unsaved_by_stage", "side_unsaved_bytes")):
        by_stage = metadata.get(name)
        if by_stage is None:
            continue
        if len(by_stage) != len(stages) or any(isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= 2**50
                                               for b in by_stage):
            raise TraceFormatError(f"{name}: must be {len(stages)} non-negative integers, one per stage")
        if sum(by_stage) != int(metadata.get(total) or 0):
            raise TraceFormatError(f"{name}: must add up to {total}")
    if metadata.get("side_values") is not None:
        values = _parse_side_values(metadata["side_values"], len(stages))
        booked = [0] * len(stages)
        for v in values:
            booked[v.stage - 1] += v.bytes
        if metadata.get("side_by_stage") is not None and booked != list(metadata["side_by_stage"]):
            raise TraceFormatError("side_values: their bytes must add up to side_by_stage, stage by stage")
    if metadata.get("grads") not in (None, *GRAD_CONVENTIONS):
        raise TraceFormatError(f"grads: must be one of {', '.join(GRAD_CONVENTIONS)}, got {metadata['grads']!r}")
    if metadata.get("mode") not in (None, *MODES):
        raise TraceFormatError(f"mode: must be one of {', '.join(MODES)}, got {metadata['mode']!r}")
    graph = _parse_graph(obj["graph"]) if obj.get("graph") is not None else None
    return Trace(input_bytes=input_bytes, stages=stages, metadata=metadata, graph=graph)


def loads_trace(text: str | bytes) -> Trace:
    """Parse and validate trace JSON text (refusing what remat cannot keep: ``wire_json``)."""
    try:
        obj = wire_json.loads(text, where="trace")
    except wire_json.WireJSONError as exc:
        raise TraceFormatError(str(exc)) from None
    return parse_trace(obj)


def load_trace(path: str | Path) -> Trace:
    """Read and validate a trace file of at most ``MAX_TRACE_FILE_BYTES``."""
    try:
        data = read_limited(path, MAX_TRACE_FILE_BYTES, "a trace file")
    except FileTooLargeError as exc:
        raise TraceFormatError(f"trace file {str(path)!r}: {exc}") from None
    except OSError as exc:
        raise TraceFormatError(f"trace file {str(path)!r}: cannot be read ({exc.strerror})") from None
    return loads_trace(data)


def make_trace(output_bytes: Sequence[int], saved_bytes: Sequence[int] | None = None, *,
               input_bytes: int = 0, **metadata: Any) -> Trace:
    """Build a minimal trace from d and e columns (tests, benchmarks, examples)."""
    saved = saved_bytes if saved_bytes is not None else output_bytes
    if len(saved) != len(output_bytes):
        raise TraceFormatError("stages: output_bytes and saved_bytes differ in length")
    return parse_trace({
        "format": TRACE_FORMAT, "input_bytes": input_bytes, **metadata,
        "stages": [{"name": f"s{i + 1}", "output_bytes": d, "saved_bytes": e}
                   for i, (d, e) in enumerate(zip(output_bytes, saved, strict=True))],
    })


def content_sha256(trace: Trace) -> str:
    """Digest of a trace's canonical JSON: equal traces, however formatted, have one.

    It names a trace's content wherever one trace must be told from another (the database's dedupe, a derived
    trace's sources), and needs nothing but the trace, so the torch-free planning core may use it.
    """
    text = json.dumps(trace.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
