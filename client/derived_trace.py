"""Traces at any batch size or sequence length, derived from profiles of one architecture at a few sizes.

A plan is keyed on the exact input shape, so a new batch size (or, for a token model, a new sequence length)
used to mean a new profile, on the training node, at the size where memory is tightest. Yet what a trace
records is, stage by stage, a low-degree polynomial in either size. In the batch it is affine: activations,
saved tensors and temporaries grow with it, weights and parameter gradients do not (shared/any-batch.md
measured 92 of 92 per-stage fields of ResNet-18 at 32 px exactly affine, to the byte). In the sequence length
L it is affine too, except what attention holds per pair of positions: an implementation that materialises
the (L, L) scores (``eager``, and ``sdpa`` wherever PyTorch falls back to its math kernel: on the CPU, in
training with attention dropout, with a padding mask) holds bytes in L², a fused one (``flash_attention_2``)
does not. So :func:`fit_batches` and :func:`fit_lengths` line up traces that differ in one size only, and
:meth:`SizeFit.trace_at` writes the trace at any other, without running the model.

The fit's **degree** is 1 in the batch; in the sequence length it is what the trace's attention implementation
(metadata ``attention``, recorded by the profiler from the model's configuration) needs: :data:`ATTENTION_DEGREE`,
2 where it is not known. Degree d needs d + 1 profiles; more show which fields are off the fit.

How each value is carried over (every leaf of the trace's JSON, extras included):

- **byte counts and other integers**: the piecewise polynomial of the fit's degree through the profiled points
  (each stretch through the d + 1 profiles around it), extended past the first and last point by the end
  pieces, rounded up to an integer. On the profiled points it is exact by construction; with d + 1 profiles it
  is their one polynomial. A field whose points do not lie on one such polynomial is *off the fit* and is
  listed in :attr:`SizeFit.off_fit` with how far its other points sit from the polynomial through spread ones:
  a peak that is the maximum of several terms (which transient decides a stage's backward peak can change with
  the size: shared/any-batch.md) is convex, so past the last profile the end piece is exact while the same term
  stays on top and low once a steeper term overtakes it, which only a profile at a larger size can show. Peaks
  are therefore derived from their per-op levels (NOTE [ peak levels ]) where the profiles have them, and a
  derived trace's plans are validated by a measured step before they count as ordinary plans.
- **times** (``*_ms``): the least-squares polynomial of the fit's degree over every profile, never falling
  with the size and never below zero (timings are noisy; a piecewise fit through noise would be worse).
- **the size itself**: ``batch_size`` and the first dimension of ``input_shape``, or ``input_shape``'s second
  (the tokens of one sample) are set.
- **everything else** (names, flags, the graph's edges, hashes, precision...) must be equal in every
  profile; a difference is refused, naming the field, since the profiles then do not describe one model.

A derived trace records where it came from under ``derived_from``: each profile's batch size, its sequence
length when the fit is in it, and content hash. A call of several inputs carries its sizes inside its
signature (``inputs``): a number there that is each profile's size follows it, every other one must be the
same in every profile.

Torch-free: the service derives traces for ``GET /v1/plans/{hash}?batch_size=B&seq_len=L`` without loading
torch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Literal

from remat.client import wire_json
from remat.client.errors import PlanError
from remat.client.trace import OPTIONAL_STAGE_BYTES, Trace, content_sha256, parse_trace

__all__ = ["ATTENTION_DEGREE", "DERIVED_FROM", "LEVELS", "OffTheFit", "SizeFit", "SizeFitError", "derive_at",
           "derived_along", "derived_sizes", "describe_derivation", "describe_source", "fit_batches", "fit_lengths",
           "inputs_at_batch", "inputs_at_length", "inputs_at_size", "is_derived", "piecewise_at", "sequence_degree",
           "token_length"]

LEVELS = "peak_levels"
"""A profiled stage's per-op levels of each peak field (worker/profilers/common.py, NOTE [ peak levels ]): each
level is a polynomial in the size where the peak is not, so a derived peak is the highest derived level."""
DERIVED_FROM = "derived_from"
"""Metadata of a derived trace: ``[{"batch_size": b, "content_sha256": sha}, ...]``, one per profile, each with
``"seq_len": L`` too when the fit was in the sequence length."""
ATTENTION = "attention"
"""Trace metadata: the attention implementation of a token model (``config._attn_implementation``)."""
ATTENTION_DEGREE: dict[str, int] = {"eager": 2, "sdpa": 2, "flex_attention": 2, "flash_attention_2": 1,
                                    "flash_attention_3": 1, "kernels-community/flash-attn": 1}
"""The degree in the sequence length of what each attention implementation holds. ``sdpa`` is 2: PyTorch picks
its kernel per call, and its math kernel (the CPU's in training with attention dropout, or with a mask)
materialises the scores; a fit of degree 2 is exact on affine fields too, given three profiles."""
DEFAULT_SEQUENCE_DEGREE = 2
"""The degree for an implementation not in :data:`ATTENTION_DEGREE` (or a trace that names none)."""
_UNTOUCHED_METADATA = ("profiler", DERIVED_FROM)
"""Metadata that may differ between profiles and is not carried over as a fitted value."""

Along = Literal["batch", "seq_len"]
_COUNTS = {2: "two", 3: "three", 4: "four"}


class SizeFitError(PlanError):
    """Profiles that cannot be lined up: the message names the field and the sizes that disagree."""


@dataclass(frozen=True, slots=True)
class OffTheFit:
    """A field whose profiled values do not lie on one polynomial of the fit's degree in the size."""

    field: str
    """Where it is, as errors name fields: ``stages[3].backward_peak_bytes``."""
    values: tuple[tuple[int, float], ...]
    """(size, value) per profile."""
    deviation: float
    """The largest distance of another profile's value from the polynomial through spread ones (the first and
    last, for a line), in the field's own unit (bytes)."""
    relative: float
    """That distance over the value there."""
    why: str = ""
    """Why it is listed, when it is not the distance: a peak whose levels could not be lined up."""

    def describe(self) -> str:
        points = ", ".join(f"{b}: {v:g}" for b, v in self.values)
        if self.why:
            return f"{self.field} ({points}; {self.why})"
        return f"{self.field} ({points}; {self.deviation:g} off the fit, {self.relative:.2%})"


def is_derived(trace: Trace) -> bool:
    """Whether ``trace`` was derived rather than profiled."""
    return bool(trace.metadata.get(DERIVED_FROM))


def _metadata(trace: Trace | Mapping[str, Any] | None) -> Mapping[str, Any]:
    return trace.metadata if isinstance(trace, Trace) else trace or {}


def derived_along(trace: Trace | Mapping[str, Any] | None) -> Along | None:
    """The size ``trace`` (or a stored trace's metadata) was derived along: ``seq_len`` when its profiles name
    their sequence lengths, else ``batch``; None for a profile."""
    sources = _metadata(trace).get(DERIVED_FROM) or ()
    if not sources:
        return None
    return "seq_len" if "seq_len" in sources[0] else "batch"


def derived_sizes(trace: Trace | Mapping[str, Any] | None) -> tuple[int, ...]:
    """The sizes (batch sizes, or sequence lengths for a fit in them) of the profiles ``trace`` (or a stored
    trace's metadata) was derived from; empty for a profile."""
    name = "seq_len" if derived_along(trace) == "seq_len" else "batch_size"
    return tuple(int(p[name]) for p in _metadata(trace).get(DERIVED_FROM) or ())


def describe_derivation(along: str | None, sizes: Sequence[int]) -> str:
    """``profiles at batch 2, 4`` or ``profiles at 64, 128, 256 tokens``: how every surface names a derived
    trace's sources."""
    joined = ", ".join(str(s) for s in sizes)
    return f"profiles at {joined} tokens" if along == "seq_len" else f"profiles at batch {joined}"


def describe_source(trace: Trace) -> str:
    """Where a derived trace came from, with the degree of a fit in the sequence length and why:
    ``profiles at 8, 16, 24 tokens (degree 2: attention 'sdpa' holds the (L, L) attention scores)``."""
    along, sizes = derived_along(trace), derived_sizes(trace)
    text = describe_derivation(along, sizes)
    if along == "seq_len":
        degree, why = sequence_degree(trace)
        text += f" (degree {degree}: {why})"
    return text


def sequence_degree(trace: Trace) -> tuple[int, str]:
    """The degree of a fit in the sequence length for ``trace``'s attention implementation, and why."""
    name = trace.metadata.get(ATTENTION)
    if isinstance(name, str) and name in ATTENTION_DEGREE:
        degree = ATTENTION_DEGREE[name]
        held = "the (L, L) attention scores" if degree == 2 else "nothing per pair of positions"
        return degree, f"attention {name!r} holds {held}"
    return DEFAULT_SEQUENCE_DEGREE, (f"attention {name!r} is not one remat knows: degree 2 covers one that "
                                     f"materialises its scores" if name else
                                     "the trace names no attention implementation: degree 2 covers one that "
                                     "materialises its scores")


@dataclass(frozen=True, slots=True)
class _Dimension:
    """One size a fit runs along: where a trace holds it and which of its fields follow it."""

    along: Along

    @property
    def index(self) -> int:
        """The size's dimension in ``input_shape``: the batch first, a sample's tokens second."""
        return 0 if self.along == "batch" else 1

    def size(self, trace: Trace) -> int:
        shape = trace.metadata.get("input_shape")
        if not shape:
            raise SizeFitError("input_shape: a profile without an input shape has no size to fit")
        batch = trace.metadata.get("batch_size", shape[0])
        if batch != shape[0]:
            raise SizeFitError(f"batch_size: {batch} is not input_shape's first dimension {shape[0]}")
        if self.along == "batch":
            return int(batch)
        if len(shape) != 2:
            raise SizeFitError(f"input_shape: {list(shape)} is not [batch, seq_len]; only a token model's "
                               f"profiles fit in the sequence length")
        if shape[1] == shape[0]:
            raise SizeFitError(f"input_shape: {list(shape)} has as many tokens as samples, so its signature "
                               f"cannot tell the two apart; profile at another sequence length")
        return int(shape[1])

    def fixed_shape(self, trace: Trace) -> list[int]:
        """What of ``input_shape`` must be equal in every profile (the size's entry zeroed)."""
        shape = list(trace.metadata["input_shape"])
        shape[self.index] = 0
        return shape

    def set(self, tree: dict[str, Any], template: Trace, size: int) -> None:
        """Write ``size`` into a derived trace's JSON, whose size fields :meth:`fitted_part` removed."""
        shape = list(template.metadata["input_shape"])
        shape[self.index] = size
        tree["input_shape"] = shape
        tree["batch_size"] = shape[0]

    def source(self, trace: Trace) -> dict[str, Any]:
        out: dict[str, Any] = {"batch_size": int(trace.metadata["input_shape"][0])}
        if self.along == "seq_len":
            out["seq_len"] = self.size(trace)
        return {**out, "content_sha256": content_sha256(trace)}

    def word(self, size: int) -> str:
        return f"batch {size}" if self.along == "batch" else f"{size} tokens"


@dataclass(frozen=True)
class SizeFit:
    """Profiles of one architecture at several sizes of one dimension, lined up field by field."""

    along: Along
    """The size the profiles differ in: ``batch`` or ``seq_len`` (tokens per sample)."""
    sizes: tuple[int, ...]
    """The profiled sizes, ascending."""
    profiles: tuple[Trace, ...]
    """The profiles, in the order of :attr:`sizes`."""
    degree: int
    """The degree of the fit's polynomials: 1 in the batch; :func:`sequence_degree` in the sequence length."""
    why_degree: str
    """Why that degree (the attention implementation, for a fit in the sequence length)."""
    off_fit: tuple[OffTheFit, ...]
    """Fields whose profiled values are not on one polynomial of :attr:`degree` (empty with degree + 1
    profiles: so many points always are)."""
    trees: list[dict[str, Any]] = field(repr=False, compare=False)
    """The profiles' fitted parts, lined up once (:func:`_aligned`): every :meth:`trace_at` carries them over,
    and a max-batch search asks for dozens of sizes. Read, never changed (:func:`_carry` builds new trees)."""

    def trace_at(self, size: int) -> Trace:
        """The trace at ``size``: a profiled one as it is, else derived (module docstring)."""
        if size < 1:
            raise SizeFitError(f"{self.along}: must be at least 1, got {size}")
        if size in self.sizes:
            return self.profiles[self.sizes.index(size)]
        dimension = _Dimension(self.along)
        derived = _carry(self.trees, self.sizes, size, (), self.degree)
        if isinstance(derived.get("inputs"), dict):
            derived["inputs"] = _joined(derived["inputs"], size)
        for stage in derived["stages"]:
            for name, levels in stage.get(LEVELS, {}).items():
                stage[name] = max(0, max(levels))  # the peak is the highest of its levels (NOTE [ peak levels ])
        dimension.set(derived, self.profiles[0], size)
        derived[DERIVED_FROM] = [dimension.source(p) for p in self.profiles]
        return parse_trace(derived)

    def describe(self) -> str:
        """One paragraph: the sizes, the degree and what is off the fit."""
        head = describe_derivation(self.along, self.sizes)
        if self.along == "seq_len":
            head += f", degree {self.degree} ({self.why_degree})"
        if not self.off_fit:
            if len(self.sizes) == self.degree + 1:
                return (f"{head}: every field fitted by the {'line' if self.degree == 1 else 'polynomial'} through "
                        f"them ({self.degree + 1} points cannot show more)")
            return f"{head}: every field exactly on the fit"
        return f"{head}: {len(self.off_fit)} fields off the fit: " + "; ".join(f.describe() for f in self.off_fit)


_TOKEN_IDS = re.compile(r"^\s*\w+: u?int\d+\[\d+, \d+\]")
"""A call signature whose first input is a 2-D integer tensor: token ids ``(batch, seq_len)``."""


def token_length(input_shape: Sequence[int], inputs: str) -> int | None:
    """The sequence length of a key or trace whose call takes token ids first (``input_ids: int64[2, 256]``),
    else None: a fit in the second dimension means something for token models only."""
    if len(input_shape) != 2 or not _TOKEN_IDS.match(inputs or ""):
        return None
    return int(input_shape[1])


def derive_at(profiles: Sequence[Trace], input_shape: Sequence[int], inputs: str = "") -> Trace | None:
    """The trace at ``input_shape`` (a key's, with its call signature ``inputs``) from stored profiles of one key
    at other sizes (a plan store's ``size_profiles``); None with too few.

    Profiles at the asked sequence length (or sample shape) and other batch sizes are fitted in the batch;
    a token model's profiles at the asked batch and other sequence lengths, in the sequence length. Both
    families may be offered: the batch's fit, which needs two profiles, goes first.

    Raises:
        SizeFitError: the profiles do not line up (:func:`fit_batches`, :func:`fit_lengths`).
    """
    batch_size, seq_len = int(input_shape[0]), token_length(input_shape, inputs)

    def sample(trace: Trace) -> list[int]:
        return list(trace.metadata.get("input_shape") or ())[1:]

    at_sample = [p for p in profiles if sample(p) == list(input_shape[1:])]
    if len({p.metadata.get("batch_size") for p in at_sample}) >= 2:
        return fit_batches(at_sample).trace_at(batch_size)
    if seq_len is None:
        return None
    at_batch = [p for p in profiles if p.metadata.get("batch_size") == batch_size and sample(p) != [seq_len]
                and token_length(p.metadata.get("input_shape") or (), p.metadata.get("inputs", "")) is not None]
    lengths = {tuple(sample(p)) for p in at_batch}
    if not at_batch or len(lengths) < sequence_degree(at_batch[0])[0] + 1:
        return None
    return fit_lengths(at_batch).trace_at(seq_len)


def _fitted_part(trace: Trace, dimension: _Dimension) -> dict[str, Any]:
    """A profile's JSON less what is set rather than fitted (the size) or not carried over (provenance), with
    a call's signature split into its text and its numbers: those equal to the size follow it (a tensor's batch
    or sequence dimension), the others must be equal (other sizes, constants)."""
    tree = trace.to_dict()
    size = dimension.size(trace)
    for name in ("batch_size", *_UNTOUCHED_METADATA):
        tree.pop(name, None)
    tree["input_shape"] = dimension.fixed_shape(trace)  # the rest must be equal in every profile
    if tree.get("inputs"):
        tree["inputs"] = _split_inputs(tree["inputs"], size)  # text: not fitted
    return tree


_SIZE = "<size>"
"""A number of a call's signature that is the profile's size (a tensor's batch or sequence dimension): set to
the derived size, like ``input_shape``'s; every other number must be the same in every profile."""


_NUMBER = re.compile(r"(?<![\w.'])(\d+)(?![\w.'])")
"""Integers of a call's signature (``input_ids: int64[2, 256]; use_cache=False``): shapes and integer
constants, not digits inside names (``int64``) or strings."""


def inputs_at_size(inputs: str, size: int, other: int) -> str:
    """A call's signature (a key's ``inputs``) at ``size`` as it reads at ``other``: the numbers equal to
    ``size`` follow it, as a derived trace's do. How a store finds a key's profiles at other batch sizes
    (``input_ids: int64[2, 256]`` at batch 2 is ``input_ids: int64[8, 256]`` at 8) and a token call's at other
    lengths (at 256 tokens, ``input_ids: int64[2, 64]`` at 64); "" stays ""."""
    return _joined(_split_inputs(inputs, size), other)


inputs_at_batch = inputs_at_size
""":func:`inputs_at_size` of a batch size."""
inputs_at_length = inputs_at_size
""":func:`inputs_at_size` of a token call's sequence length."""


def _split_inputs(inputs: str, size: int) -> dict[str, Any]:
    """A call's signature as its text and its numbers, those equal to ``size`` marked ``_SIZE``."""
    pieces = _NUMBER.split(inputs)
    return {"text": pieces[0::2], "numbers": [_SIZE if int(n) == size else n for n in pieces[1::2]]}


def _joined(inputs: dict[str, Any], size: int) -> str:
    text, numbers = inputs["text"], [size if n == _SIZE else n for n in inputs["numbers"]]
    return "".join(t + (str(n) if k < len(numbers) else "") for k, (t, n) in
                   enumerate(zip(text, [*numbers, None], strict=True)))


def fit_batches(profiles: Sequence[Trace]) -> SizeFit:
    """Line up profiles that differ only in their batch size (a fit of degree 1).

    Raises:
        SizeFitError: fewer than two distinct batch sizes, or profiles that differ in anything but the batch
            (another architecture, sample shape, precision, stage cut...), naming the first such field.
    """
    return _fit(profiles, _Dimension("batch"), 1, "")


def fit_lengths(profiles: Sequence[Trace]) -> SizeFit:
    """Line up a token model's profiles that differ only in their sequence length, with the degree their
    attention implementation needs (:func:`sequence_degree`).

    Raises:
        SizeFitError: fewer distinct lengths than the degree needs, samples that are not token sequences, or
            profiles that differ in anything but the length, naming the first such field.
    """
    if not profiles:
        raise SizeFitError("seq_len: fitting needs profiles, got none")
    degree, why = sequence_degree(profiles[0])
    return _fit(profiles, _Dimension("seq_len"), degree, why)


def _fit(profiles: Sequence[Trace], dimension: _Dimension, degree: int, why: str) -> SizeFit:
    by_size: dict[int, Trace] = {}
    for profile in profiles:
        if is_derived(profile):
            raise SizeFitError(f"{DERIVED_FROM}: a trace derived at {dimension.word(dimension.size(profile))} is not "
                               f"a profile; fit the profiles it came from")
        by_size.setdefault(dimension.size(profile), profile)
    field, plural = ("batch_size", "batch sizes") if dimension.along == "batch" else ("seq_len", "sequence lengths")
    if len(by_size) < degree + 1:
        how = f"with degree {degree} ({why}) " if why else ""
        raise SizeFitError(f"{field}: fitting {how}needs profiles at {_COUNTS.get(degree + 1, degree + 1)} {plural} "
                           f"or more, got {sorted(by_size) or 'none'}")
    sizes = tuple(sorted(by_size))
    ordered = tuple(by_size[s] for s in sizes)
    fixed = {tuple(dimension.fixed_shape(p)) for p in ordered}
    if len(fixed) > 1:
        shapes = ", ".join(str(list(p.metadata["input_shape"])) for p in ordered)
        raise SizeFitError(f"input_shape: the profiles' shapes differ ({shapes}): only the {field} may")
    trees, unaligned = _aligned(ordered, dimension)
    by_levels = {f"stages[{i}].{name}" for i, stage in enumerate(trees[0]["stages"]) for name in stage.get(LEVELS, {})}
    off_fit = tuple(f for f in _off_fit(trees, sizes, (), degree) if f.field not in by_levels) + unaligned
    _carry(trees, sizes, sizes[-1] * 2, (), degree)  # refuses what differs, before anyone derives
    return SizeFit(along=dimension.along, sizes=sizes, profiles=ordered, degree=degree, why_degree=why,
                   off_fit=off_fit, trees=trees)


def _aligned(profiles: Sequence[Trace], dimension: _Dimension) -> tuple[list[dict[str, Any]], tuple[OffTheFit, ...]]:
    """The profiles' fitted parts, with the peak levels of a field kept only where every profile has them, in
    the same number (the same ops in the window); the others listed as not known to be on the fit."""
    trees = [_fitted_part(p, dimension) for p in profiles]
    unaligned: list[OffTheFit] = []
    for i, stages in enumerate(zip(*(t["stages"] for t in trees), strict=False)):
        names = set().union(*(stage.get(LEVELS, {}) for stage in stages))
        for name in sorted(names):
            lengths = {len(stage.get(LEVELS, {}).get(name, ())) for stage in stages}
            if len(lengths) == 1 and 0 not in lengths:
                continue
            for stage in stages:
                stage.get(LEVELS, {}).pop(name, None)
            unaligned.append(OffTheFit(
                field=f"stages[{i}].{name}", values=tuple((dimension.size(p), float(st.get(name, 0)))
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
                raise SizeFitError(f"{_where((*path, key))}: present in some profiles only")
            yield values, (*path, key)
    else:
        lengths = {len(tree) for tree in trees}
        if len(lengths) > 1:
            raise SizeFitError(f"{_where(path)}: {sorted(lengths)} entries in different profiles (another stage "
                               f"cut or graph); profile every size with the same model and remat")
        for i in range(len(first)):
            yield [tree[i] for tree in trees], (*path, i)


def _carry(trees: Sequence[Any], sizes: Sequence[int], size: int, path: Path, degree: int) -> Any:
    """The value at ``size`` of every leaf, recursively (module docstring)."""
    first = trees[0]
    if isinstance(first, dict | list):
        if not all(isinstance(t, type(first)) for t in trees):
            raise SizeFitError(f"{_where(path)}: differs in kind between profiles")
        pairs = list(_children(trees, path))
        if isinstance(first, dict):
            return {child[-1]: _carry(values, sizes, size, child, degree) for values, child in pairs}
        return [_carry(values, sizes, size, child, degree) for values, child in pairs]
    if all(_is_number(t) for t in trees):
        if all(t == first for t in trees):
            return first
        is_time = isinstance(path[-1], str) and path[-1].endswith("_ms")
        if is_time or not all(isinstance(t, int) for t in trees):
            return _least_squares(sizes, trees, size, degree, rising=is_time)
        return piecewise_at(sizes, trees, size, degree)
    if any(t != first for t in trees):
        shown = ", ".join(f"{b}: {t!r}" for b, t in zip(sizes, trees, strict=True))
        raise SizeFitError(f"{_where(path)}: differs between the profiles ({shown}); only the size may")
    return first


def _through(points: Sequence[tuple[int, int | float]], x: int) -> Fraction:
    """The value at ``x`` of the polynomial through ``points`` (Lagrange's form, exact in fractions)."""
    total = Fraction(0)
    for i, (xi, yi) in enumerate(points):
        term = Fraction(yi)
        for j, (xj, _) in enumerate(points):
            if j != i:
                term *= Fraction(x - xj, xi - xj)
        total += term
    return total


def piecewise_at(sizes: Sequence[int], values: Sequence[int], size: int, degree: int) -> int:
    """The piecewise polynomial of ``degree`` through the points, each piece through the ``degree + 1``
    profiles around ``size`` and the end pieces extended, rounded up (a byte count below zero, where a piece
    extended to a small size would go, is zero). Degree 1 is the piecewise-linear function."""
    below = sum(1 for s in sizes if s < size)
    start = min(max(below - 1, 0), len(sizes) - degree - 1)
    window = list(zip(sizes, values, strict=True))[start:start + degree + 1]
    value = math.ceil(_through(window, size))
    return max(0, value) if min(values) >= 0 else value


def _least_squares(sizes: Sequence[int], values: Sequence[float], size: int, degree: int, *,
                   rising: bool = False) -> float:
    """The least-squares polynomial of ``degree`` through the points at ``size``, never below zero. ``rising``
    (times): never below its value at a smaller profiled size, since more samples or tokens never take less
    time. Two noisy profiles whose larger batch happened to time faster would otherwise extrapolate every
    stage's time to zero at a larger batch (seen in CI: all of a ResNet-18's recompute costs at batch 6, from
    profiles at 3 and 4, and a frontier of one point)."""
    if degree == 1:
        n = len(sizes)
        mean_b, mean_v = sum(sizes) / n, sum(values) / n
        var = sum((b - mean_b) ** 2 for b in sizes)
        slope = sum((b - mean_b) * (v - mean_v) for b, v in zip(sizes, values, strict=True)) / var
        if rising:
            slope = max(slope, 0.0)
        return max(0.0, mean_v + slope * (size - mean_b))
    coefficients = _polynomial_least_squares(sizes, values, degree)

    def at(x: float) -> float:
        return sum(c * x ** k for k, c in enumerate(coefficients))

    value = at(size)
    if rising:
        value = max([value, *(at(s) for s in sizes if s <= size)])
    return max(0.0, value)


def _polynomial_least_squares(sizes: Sequence[int], values: Sequence[float], degree: int) -> list[float]:
    """Coefficients (constant first) of the least-squares polynomial of ``degree``, by the normal equations in
    exact fractions (a handful of points: no numerical library needed, nor its rounding)."""
    n = degree + 1
    xs = [Fraction(s) for s in sizes]
    matrix = [[sum((x ** (i + j) for x in xs), Fraction(0)) for j in range(n)] for i in range(n)]
    rhs = [sum((x ** i * Fraction(v) for x, v in zip(xs, values, strict=True)), Fraction(0)) for i in range(n)]
    for col in range(n):  # Gauss-Jordan: the matrix is a Gram matrix of distinct points, so pivots are nonzero
        pivot = next(r for r in range(col, n) if matrix[r][col] != 0)
        matrix[col], matrix[pivot] = matrix[pivot], matrix[col]
        rhs[col], rhs[pivot] = rhs[pivot], rhs[col]
        for r in range(n):
            if r != col and matrix[r][col] != 0:
                factor = matrix[r][col] / matrix[col][col]
                matrix[r] = [a - factor * b for a, b in zip(matrix[r], matrix[col], strict=True)]
                rhs[r] -= factor * rhs[col]
    return [float(rhs[i] / matrix[i][i]) for i in range(n)]


def _spread(count: int, degree: int) -> list[int]:
    """``degree + 1`` indices spread over ``count`` points, the first and last among them."""
    return sorted({round(k * (count - 1) / degree) for k in range(degree + 1)})


def _off_fit(trees: Sequence[Any], sizes: Sequence[int], path: Path, degree: int) -> Iterator[OffTheFit]:
    """Integer fields whose other points leave the polynomial through spread ones (the outer two, for a
    line)."""
    first = trees[0]
    if isinstance(first, dict | list):
        for values, child in _children(trees, path):
            yield from _off_fit(values, sizes, child, degree)
        return
    if len(sizes) < degree + 2 or not all(isinstance(t, int) and not isinstance(t, bool) for t in trees):
        return
    chosen = _spread(len(sizes), degree)
    through = [(sizes[i], trees[i]) for i in chosen]
    worst, at = Fraction(0), 0
    for i, (s, v) in enumerate(zip(sizes, trees, strict=True)):
        if i in chosen:
            continue
        off = abs(v - _through(through, s))
        if off > worst:
            worst, at = off, v
    if worst > 0:
        yield OffTheFit(field=_where(path), values=tuple(zip(sizes, trees, strict=True)), deviation=float(worst),
                        relative=float(worst) / max(abs(at), 1))
