"""The measurement: what one real training step with a plan applied was measured to cost.

One definition from ``remat.worker.measure.measure_step`` to the database row (``service/models.py``'s
``MeasurementRow`` has a column for each of :data:`STORED_FIELDS`, a test holds them equal), the HTTP API
(``MeasurementOut``/``MeasurementCreate`` are built from these fields) and the CLI's ``measure --json``.
It lives in the client package because it is plain data: no torch, no database.

NOTE [ measured peak ] is in worker/measure.py: ``measured_peak_bytes`` is the activation peak, i.e. the
highest allocation during forward + loss + backward minus what was allocated just before the step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

__all__ = ["CONTEXT_FIELDS", "STORED_FIELDS", "Measurement", "within_noise"]


@dataclass(kw_only=True, frozen=True, slots=True)
class Measurement:
    """A validation run of one plan (or of no checkpoints) on one device."""

    algorithm: str | None = None
    """The planner whose plan was measured (None: checkpoints given by hand)."""
    checkpoints: tuple[int, ...] | None = None
    """The checkpoints that ran; None when storing means "the plan's current checkpoints"."""
    dropped_vertices: tuple[int, ...] | None = None
    """A graph plan: the op-graph vertices that were recomputed (``Plan.dropped_vertices``); None for a chain
    plan, and when storing a graph plan's measurement, "the plan's current vertices"."""
    predicted_peak_bytes: int | None = None
    """The ``pytorch`` cost model's prediction for these checkpoints, from the trace of the same run."""
    measured_peak_bytes: int | None = None
    """Activation peak: highest allocation during the step minus the allocation just before it."""
    baseline_predicted_peak_bytes: int | None = None
    baseline_measured_peak_bytes: int | None = None
    """The same two with no checkpoints (None when not measured)."""
    absolute_peak_bytes: int | None = None
    """The step's peak including what existed before it (weights, gradients, the batch)."""
    measured_reserved_bytes: int | None = None
    """CUDA: the caching allocator's reserved peak during the step (None on CPU)."""
    requested_peak_bytes: int | None = None
    """CUDA: the peak of bytes requested above the pre-step baseline, before the allocator rounds them."""
    step_ms: float | None = None
    """The step's time, from interleaved rounds of every plan measured with it. The no-checkpoint step's is the
    least over the rounds (noise on a shared machine mostly adds time) of each round's median no-checkpoint step;
    a plan measured beside it is that time plus the median over the rounds of the plan's step less the mean of
    the no-checkpoint steps run just before and after it (NOTE [ timing a plan ]), so its change against the
    baseline is its overhead as measured."""
    baseline_step_ms: float | None = None
    step_spread_ms: float | None = None
    """How far the median over those rounds sits above their least: of the no-checkpoint step's round medians, or
    of a plan's differences from the steps beside it. A difference between two plans' times smaller than their
    spreads is within noise. None when timed once."""
    baseline_step_spread_ms: float | None = None
    device_name: str | None = None
    torch_version: str | None = None
    grad_check_passed: bool | None = None
    """Gradients with the plan applied matched those of the unmodified step (None: not checked)."""
    grad_max_abs_diff: float | None = None
    grads: str | None = None
    dtype: str | None = None
    device: str | None = None
    """The step's gradient convention, precision and device class: the plan key's, so not stored again."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    id: int | None = None
    created_at: datetime | None = None

    def __post_init__(self) -> None:
        # One JSON type per field, fresh or read back from a database: times and differences are floats.
        for name in ("step_ms", "baseline_step_ms", "step_spread_ms", "baseline_step_spread_ms", "grad_max_abs_diff"):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, name, float(value))

    @property
    def within_noise(self) -> bool:
        """The step and its baseline are within noise (:func:`within_noise`)."""
        return within_noise(self.step_ms, self.step_spread_ms, self.baseline_step_ms, self.baseline_step_spread_ms)

    @property
    def prediction_error(self) -> float | None:
        """predicted / measured - 1, when both are known."""
        if self.predicted_peak_bytes is None or not self.measured_peak_bytes:
            return None
        return self.predicted_peak_bytes / self.measured_peak_bytes - 1.0

    def to_dict(self, *, timelines: bool = True) -> dict[str, Any]:
        """JSON form: every field, ``prediction_error``, and the two names ``remat-client measure --json``
        has always printed for the measured peaks (``activation_measured_bytes`` and its baseline).
        ``timelines=False`` leaves the ``TIMELINE_KEYS`` out of ``extra``."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("checkpoints", "dropped_vertices") and value is not None:
                value = list(value)
            elif f.name == "extra":
                value = {k: v for k, v in value.items() if timelines or k not in TIMELINE_KEYS}
            elif f.name == "created_at" and value is not None:
                value = value.isoformat()
            out[f.name] = value
        out["prediction_error"] = self.prediction_error
        out["activation_measured_bytes"] = self.measured_peak_bytes
        out["baseline_activation_measured_bytes"] = self.baseline_measured_peak_bytes
        return out

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Measurement:
        """Parse ``to_dict``'s form (unknown and derived keys are ignored)."""
        known = {f.name for f in fields(cls)} - {"id", "created_at"}
        values = {k: v for k, v in obj.items() if k in known}
        for name in ("checkpoints", "dropped_vertices"):
            if values.get(name) is not None:
                values[name] = tuple(values[name])
        return cls(**values)


def within_noise(step_ms: float | None, spread_ms: float | None, baseline_ms: float | None,
                 baseline_spread_ms: float | None) -> bool:
    """Two step times differ by no more than the larger of their spreads: neither is faster or slower by what
    the measurement can tell apart (False when either time is missing; a missing spread counts as 0)."""
    if step_ms is None or baseline_ms is None:
        return False
    return abs(step_ms - baseline_ms) <= max(spread_ms or 0.0, baseline_spread_ms or 0.0)


TIMELINE_KEYS = ("timeline", "baseline_timeline")
"""``extra`` entries holding memory over the measured step (CPU meter): hundreds of numbers each, so plan
records served to training jobs leave them out and ``GET /v1/plans/{hash}/timeline`` serves them."""

CONTEXT_FIELDS = ("algorithm", "grads", "dtype", "device")
"""Fields a stored measurement takes from the plan it belongs to, not from a column of its own."""
STORED_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Measurement)
                                       if f.name not in (*CONTEXT_FIELDS, "id", "created_at"))
"""The columns of the measurements table, besides its id, plan and creation time."""
