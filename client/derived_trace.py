"""Traces at any batch size, derived from profiles of one architecture at a few batch sizes.

A plan is keyed on the exact input shape, so a new batch size used to mean a new profile, on the training
node, at the size where memory is tightest. Yet what a trace records is, stage by stage, affine in the batch:
activations, saved tensors and temporaries grow with it, weights and parameter gradients do not
(shared/any-batch.md measured 92 of 92 per-stage fields of ResNet-18 at 32 px exactly affine, to the byte).
So :func:`fit_batches` lines up traces that differ only in their batch size and :meth:`BatchFit.trace_at`
writes the trace at any other batch, without running the model.

How each value is carried over (every leaf of the trace's JSON, extras included):

- **byte counts and other integers**: the piecewise-linear function through the profiled points, extended
  past the first and last point by the end segments, rounded up to an integer. On the profiled points it is
  exact by construction; with two profiles it is their line. A field whose points do not lie on one line is
  *not affine* and is listed in :attr:`BatchFit.not_affine` with how far its middle points sit from the line
  through the outer ones: a peak that is the maximum of several affine terms (which transient decides a
  stage's backward peak can change with the batch: shared/any-batch.md) is convex, so past the last profile
  the end segment is exact while the same term stays on top and low once a steeper term overtakes it, which
  only a profile at a larger batch can show. A derived trace's plans are therefore validated by a measured
  step before they count as ordinary plans.
- **times** (``*_ms``): the least-squares line over every profile, never falling with the batch and never
  below zero (timings are noisy; a piecewise line through noise would be worse).
- **the batch itself**: ``batch_size`` and the first dimension of ``input_shape`` are set.
- **everything else** (names, flags, the graph's edges, hashes, precision...) must be equal in every
  profile; a difference is refused, naming the field, since the profiles then do not describe one model.

A derived trace records where it came from under ``derived_from``: each profile's batch size and content
hash. A call of several inputs carries its batch inside its signature (``inputs``): a number there that is
each profile's batch size follows the batch, every other one must be the same in every profile.

Torch-free: the service derives traces for ``GET /v1/plans/{hash}?batch_size=B`` without loading torch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from remat.client import wire_json
from remat.client.errors import PlanError
from remat.client.trace import OPTIONAL_STAGE_BYTES, Trace, content_sha256, parse_trace

__all__ = ["DERIVED_FROM", "LEVELS", "BatchFit", "BatchFitError", "NotAffine", "derive_at", "derived_batches",
           "fit_batches", "inputs_at_batch", "is_derived"]

LEVELS = "peak_levels"
"""A profiled stage's per-op levels of each peak field (worker/profilers/common.py, NOTE [ peak levels ]): each
level is affine in the batch size where the peak is not, so a derived peak is the highest derived level."""
DERIVED_FROM = "derived_from"
"""Metadata of a derived trace: ``[{"batch_size": b, "content_sha256": sha}, ...]``, one per profile."""
_BATCH_FIELDS = ("batch_size", "input_shape")
_UNTOUCHED_METADATA = ("profiler", DERIVED_FROM)
"""Metadata that may differ between profiles and is not carried over as a fitted value."""


class BatchFitError(PlanError):
    """Profiles that cannot be lined up: the message names the field and the batches that disagree."""


@dataclass(frozen=True, slots=True)
class NotAffine:
    """A field whose profiled values do not lie on one line in the batch size."""

    field: str
    """Where it is, as errors name fields: ``stages[3].backward_peak_bytes``."""
    values: tuple[tuple[int, float], ...]
    """(batch, value) per profile."""
    deviation: float
    """The largest distance of a middle profile's value from the line through the first and last, in the
    field's own unit (bytes)."""
    relative: float
    """That distance over the value there."""
    why: str = ""
    """Why it is listed, when it is not the distance: a peak whose levels could not be lined up."""

    def describe(self) -> str:
        points = ", ".join(f"{b}: {v:g}" for b, v in self.values)
        if self.why:
            return f"{self.field} ({points}; {self.why})"
        return f"{self.field} ({points}; {self.deviation:g} off the line, {self.relative:.2%})"


def is_derived(trace: Trace) -> bool:
    """Whether ``trace`` was derived rather than profiled."""
    return bool(trace.metadata.get(DERIVED_FROM))


def derived_batches(trace: Trace) -> tuple[int, ...]:
    """The batch sizes of the profiles ``trace`` was derived from; empty for a profile."""
    return tuple(int(p["batch_size"]) for p in trace.metadata.get(DERIVED_FROM) or ())


def _batch(trace: Trace) -> int:
    shape = trace.metadata.get("input_shape")
    if not shape:
        raise BatchFitError("input_shape: a profile without an input shape has no batch size to fit")
    batch = trace.metadata.get("batch_size", shape[0])
    if batch != shape[0]:
        raise BatchFitError(f"batch_size: {batch} is not input_shape's first dimension {shape[0]}")
    return int(batch)


@dataclass(frozen=True)
class BatchFit:
    """Profiles of one architecture at several batch sizes, lined up field by field."""

    batches: tuple[int, ...]
    """The profiled batch sizes, ascending."""
    profiles: tuple[Trace, ...]
    """The profiles, in the order of :attr:`batches`."""
    not_affine: tuple[NotAffine, ...]
    """Fields whose profiled values are not on one line (empty with two profiles: two points always are)."""

    def trace_at(self, batch_size: int) -> Trace:
        """The trace at ``batch_size``: a profiled one as it is, else derived (module docstring)."""
        if batch_size < 1:
            raise BatchFitError(f"batch_size: must be at least 1, got {batch_size}")
        if batch_size in self.batches:
            return self.profiles[self.batches.index(batch_size)]
        trees, _ = _aligned(self.profiles)
        derived = _carry(trees, self.batches, batch_size, ())
        if isinstance(derived.get("inputs"), dict):
            derived["inputs"] = _joined(derived["inputs"], batch_size)
        for stage in derived["stages"]:
            for name, levels in stage.get(LEVELS, {}).items():
                stage[name] = max(0, max(levels))  # the peak is the highest of its levels (NOTE [ peak levels ])
        derived["batch_size"] = batch_size
        derived["input_shape"] = [batch_size, *self.profiles[0].metadata["input_shape"][1:]]
        derived[DERIVED_FROM] = [{"batch_size": b, "content_sha256": content_sha256(p)}
                                 for b, p in zip(self.batches, self.profiles, strict=True)]
        return parse_trace(derived)

    def describe(self) -> str:
        """One paragraph: the batches and what is not affine."""
        head = f"profiles at batch {', '.join(map(str, self.batches))}"
        if not self.not_affine:
            if len(self.batches) == 2:
                return f"{head}: every field fitted by the line through them (two points cannot show curvature)"
            return f"{head}: every field exactly affine in the batch size"
        return f"{head}: {len(self.not_affine)} fields not affine: " + "; ".join(f.describe() for f in self.not_affine)


def derive_at(profiles: Sequence[Trace], batch_size: int) -> Trace | None:
    """The trace at ``batch_size`` from stored profiles of one key at other batch sizes (a plan store's
    ``batch_profiles``); None with fewer than two batch sizes among them.

    Raises:
        BatchFitError: the profiles do not line up (:func:`fit_batches`).
    """
    if len({p.metadata.get("batch_size") for p in profiles}) < 2:
        return None
    return fit_batches(profiles).trace_at(batch_size)


def _fitted_part(trace: Trace) -> dict[str, Any]:
    """A profile's JSON less what is set rather than fitted (the batch) or not carried over (provenance), with
    a call's signature split into its text and its numbers: those equal to the batch size follow it (a tensor's
    batch dimension), the others must be equal (sequence lengths, constants)."""
    tree = trace.to_dict()
    for name in _BATCH_FIELDS + _UNTOUCHED_METADATA:
        tree.pop(name, None)
    if tree.get("inputs"):
        tree["inputs"] = _split_inputs(tree["inputs"], _batch(trace))  # text: not fitted
    return tree


_BATCH = "<batch>"
"""A number of a call's signature that is the profile's batch size (a tensor's batch dimension): set to the
derived batch, like ``input_shape``'s first dimension; every other number must be the same in every profile."""


_NUMBER = re.compile(r"(?<![\w.'])(\d+)(?![\w.'])")
"""Integers of a call's signature (``input_ids: int64[2, 256]; use_cache=False``): shapes and integer
constants, not digits inside names (``int64``) or strings."""


def inputs_at_batch(inputs: str, batch: int, other: int) -> str:
    """A call's signature at batch ``batch`` (a key's ``inputs``) as it reads at batch ``other``: the numbers
    equal to ``batch`` follow it, as a derived trace's do. How a store finds a key's profiles at other batch
    sizes (``input_ids: int64[2, 256]`` at 2 is ``input_ids: int64[8, 256]`` at 8); "" stays ""."""
    return _joined(_split_inputs(inputs, batch), other)


def _split_inputs(inputs: str, batch: int) -> dict[str, Any]:
    """A call's signature as its text and its numbers, those equal to ``batch`` marked ``_BATCH``."""
    pieces = _NUMBER.split(inputs)
    return {"text": pieces[0::2], "numbers": [_BATCH if int(n) == batch else n for n in pieces[1::2]]}


def _joined(inputs: dict[str, Any], batch: int) -> str:
    text, numbers = inputs["text"], [batch if n == _BATCH else n for n in inputs["numbers"]]
    return "".join(t + (str(n) if k < len(numbers) else "") for k, (t, n) in
                   enumerate(zip(text, [*numbers, None], strict=True)))


def fit_batches(profiles: Sequence[Trace]) -> BatchFit:
    """Line up profiles that differ only in their batch size.

    Raises:
        BatchFitError: fewer than two distinct batch sizes, or profiles that differ in anything but the batch
            (another architecture, sample shape, precision, stage cut...), naming the first such field.
    """
    by_batch: dict[int, Trace] = {}
    for profile in profiles:
        if is_derived(profile):
            raise BatchFitError(f"{DERIVED_FROM}: a trace derived at batch {_batch(profile)} is not a profile; fit "
                                f"the profiles it came from")
        by_batch.setdefault(_batch(profile), profile)
    if len(by_batch) < 2:
        raise BatchFitError(f"batch_size: fitting needs profiles at two batch sizes or more, got "
                            f"{sorted(by_batch) or 'none'}")
    batches = tuple(sorted(by_batch))
    ordered = tuple(by_batch[b] for b in batches)
    samples = {tuple(p.metadata["input_shape"][1:]) for p in ordered}
    if len(samples) > 1:
        raise BatchFitError(f"input_shape: the profiles' samples differ ({', '.join(str(list(s)) for s in samples)}):"
                            f" only the batch size may")
    trees, unaligned = _aligned(ordered)
    by_levels = {f"stages[{i}].{name}" for i, stage in enumerate(trees[0]["stages"]) for name in stage.get(LEVELS, {})}
    not_affine = tuple(f for f in _curvature(trees, batches, ()) if f.field not in by_levels) + unaligned
    _carry(trees, batches, batches[-1] * 2, ())  # refuses what differs, before anyone derives
    return BatchFit(batches=batches, profiles=ordered, not_affine=not_affine)


def _aligned(profiles: Sequence[Trace]) -> tuple[list[dict[str, Any]], tuple[NotAffine, ...]]:
    """The profiles' fitted parts, with the peak levels of a field kept only where every profile has them, in
    the same number (the same ops in the window); the others listed as not known to be affine."""
    trees = [_fitted_part(p) for p in profiles]
    unaligned: list[NotAffine] = []
    for i, stages in enumerate(zip(*(t["stages"] for t in trees), strict=False)):
        names = set().union(*(stage.get(LEVELS, {}) for stage in stages))
        for name in sorted(names):
            lengths = {len(stage.get(LEVELS, {}).get(name, ())) for stage in stages}
            if len(lengths) == 1 and 0 not in lengths:
                continue
            for stage in stages:
                stage.get(LEVELS, {}).pop(name, None)
            unaligned.append(NotAffine(
                field=f"stages[{i}].{name}", values=tuple((_batch(p), float(st.get(name, 0)))
                                                          for p, st in zip(profiles, stages, strict=True)),
                deviation=float("nan"), relative=float("nan"),
                why="its levels differ between profiles (other ops ran, or a profile has none): fitted by its values"))
        for stage in stages:
            if LEVELS in stage and not stage[LEVELS]:
                del stage[LEVELS]
    return trees, tuple(unaligned)


# --- the walk over the traces' JSON ----------------------------------------------------------------------

Path = tuple[str | int, ...]


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _where(path: Path) -> str:
    return wire_json.place(path) or "trace"


def _children(trees: Sequence[Any], path: Path) -> Iterator[tuple[list[Any], Path]]:
    """The aligned children of equal-shaped containers, with their paths; refuses shapes that differ."""
    first = trees[0]
    if isinstance(first, dict):
        keys = list(first)
        for tree in trees[1:]:
            keys.extend(key for key in tree if key not in keys)
        for key in keys:
            default = 0 if key in OPTIONAL_STAGE_BYTES else None  # Stage.to_dict leaves zero bytes out
            values = [tree.get(key, default) for tree in trees]
            if any(v is None for v in values):
                raise BatchFitError(f"{_where((*path, key))}: present in some profiles only")
            yield values, (*path, key)
    else:
        lengths = {len(tree) for tree in trees}
        if len(lengths) > 1:
            raise BatchFitError(f"{_where(path)}: {sorted(lengths)} entries in different profiles (another stage "
                                f"cut or graph); profile every batch size with the same model and remat")
        for i in range(len(first)):
            yield [tree[i] for tree in trees], (*path, i)


def _carry(trees: Sequence[Any], batches: Sequence[int], batch: int, path: Path) -> Any:
    """The value at ``batch`` of every leaf, recursively (module docstring)."""
    first = trees[0]
    if isinstance(first, dict | list):
        if not all(isinstance(t, type(first)) for t in trees):
            raise BatchFitError(f"{_where(path)}: differs in kind between profiles")
        pairs = list(_children(trees, path))
        if isinstance(first, dict):
            return {child[-1]: _carry(values, batches, batch, child) for values, child in pairs}
        return [_carry(values, batches, batch, child) for values, child in pairs]
    if all(_is_number(t) for t in trees):
        if all(t == first for t in trees):
            return first
        is_time = isinstance(path[-1], str) and path[-1].endswith("_ms")
        if is_time or not all(isinstance(t, int) for t in trees):
            return _least_squares(batches, trees, batch, rising=is_time)
        return _piecewise(batches, trees, batch)
    if any(t != first for t in trees):
        shown = ", ".join(f"{b}: {t!r}" for b, t in zip(batches, trees, strict=True))
        raise BatchFitError(f"{_where(path)}: differs between the profiles ({shown}); only the batch size may")
    return first


def _piecewise(batches: Sequence[int], values: Sequence[int], batch: int) -> int:
    """The piecewise-linear function through the points, extended by its end segments, rounded up (a byte
    count below zero, where a line extended to a small batch would go, is zero)."""
    i = 1
    while i < len(batches) - 1 and batch > batches[i]:
        i += 1
    (b0, v0), (b1, v1) = (batches[i - 1], values[i - 1]), (batches[i], values[i])
    value = math.ceil(Fraction(v0) + Fraction(v1 - v0, b1 - b0) * (batch - b0))
    return max(0, value) if min(values) >= 0 else value


def _least_squares(batches: Sequence[int], values: Sequence[float], batch: int, *, rising: bool = False) -> float:
    """The least-squares line through the points at ``batch``, never below zero. ``rising`` (times): its slope
    is at least zero, since more samples never take less time. Two noisy profiles whose larger batch happened
    to time faster would otherwise extrapolate every stage's time to zero at a larger batch (seen in CI: all
    of a ResNet-18's recompute costs at batch 6, from profiles at 3 and 4, and a frontier of one point)."""
    n = len(batches)
    mean_b, mean_v = sum(batches) / n, sum(values) / n
    var = sum((b - mean_b) ** 2 for b in batches)
    slope = sum((b - mean_b) * (v - mean_v) for b, v in zip(batches, values, strict=True)) / var
    if rising:
        slope = max(slope, 0.0)
    return max(0.0, mean_v + slope * (batch - mean_b))


def _curvature(trees: Sequence[Any], batches: Sequence[int], path: Path) -> Iterator[NotAffine]:
    """Integer fields whose middle points leave the line through the outer ones."""
    first = trees[0]
    if isinstance(first, dict | list):
        for values, child in _children(trees, path):
            yield from _curvature(values, batches, child)
        return
    if len(batches) < 3 or not all(isinstance(t, int) and not isinstance(t, bool) for t in trees):
        return
    (b0, v0), (b1, v1) = (batches[0], trees[0]), (batches[-1], trees[-1])
    worst, at = 0.0, 0
    for b, v in zip(batches[1:-1], trees[1:-1], strict=True):
        off = abs(v - (v0 + (v1 - v0) * (b - b0) / (b1 - b0)))
        if off > worst:
            worst, at = off, v
    if worst > 0:
        yield NotAffine(field=_where(path), values=tuple(zip(batches, trees, strict=True)), deviation=worst,
                        relative=worst / max(abs(at), 1))
