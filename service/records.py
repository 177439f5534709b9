"""Plain, immutable results of the repository, detached from any database session.

The repository returns these rather than ORM rows so that callers (the HTTP API, the cache, the CLI's
embedded store) can keep them after the transaction ends and turn them into JSON without lazy loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from remat.client.plan import Plan
from remat.service.keys import PlanKey

JOB_STATES = ("pending", "queued", "running", "succeeded", "failed")
"""pending: recorded, not yet handed to the broker; queued: on the broker; running/succeeded/failed: the
worker's word. A job the broker refused is ``failed`` with an error that says so."""
FINISHED_JOB_STATES = ("succeeded", "failed")


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


@dataclass(kw_only=True, slots=True, frozen=True)
class Measurement:
    """What a validation run measured for one plan (fields as in ``remat-client measure --json``)."""

    checkpoints: tuple[int, ...] | None = None
    """The checkpoints that ran; None when storing means "the plan's current checkpoints"."""
    measured_peak_bytes: int | None = None
    """Peak allocated bytes during the step with the plan applied."""
    measured_reserved_bytes: int | None = None
    """Peak reserved bytes of the CUDA caching allocator (None on CPU)."""
    baseline_measured_peak_bytes: int | None = None
    activation_measured_bytes: int | None = None
    baseline_activation_measured_bytes: int | None = None
    step_ms: float | None = None
    baseline_step_ms: float | None = None
    device_name: str | None = None
    torch_version: str | None = None
    grad_check_passed: bool | None = None
    """Gradients with the plan matched those without it (None: not checked)."""
    grad_max_abs_diff: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    id: int | None = None
    created_at: datetime | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "checkpoints": list(self.checkpoints) if self.checkpoints is not None else None,
            "measured_peak_bytes": self.measured_peak_bytes,
            "measured_reserved_bytes": self.measured_reserved_bytes,
            "baseline_measured_peak_bytes": self.baseline_measured_peak_bytes,
            "activation_measured_bytes": self.activation_measured_bytes,
            "baseline_activation_measured_bytes": self.baseline_activation_measured_bytes,
            "step_ms": self.step_ms,
            "baseline_step_ms": self.baseline_step_ms,
            "device_name": self.device_name,
            "torch_version": self.torch_version,
            "grad_check_passed": self.grad_check_passed,
            "grad_max_abs_diff": self.grad_max_abs_diff,
            "extra": dict(self.extra),
            "created_at": _iso(self.created_at),
        }


@dataclass(kw_only=True, slots=True, frozen=True)
class StoredTrace:
    """Where ``store_trace`` put a trace."""

    trace_id: int
    key: PlanKey
    content_sha256: str
    created: bool
    """False when an identical trace was already stored (the call was a no-op)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class TraceInfo:
    """The provenance of a plan: the trace it was computed from."""

    trace_id: int
    content_sha256: str
    model: str | None
    device_name: str | None
    torch_version: str | None
    batch_size: int | None
    created_at: datetime

    def to_dict(self) -> dict[str, Any]:
        return {"trace_id": self.trace_id, "content_sha256": self.content_sha256, "model": self.model,
                "device_name": self.device_name, "torch_version": self.torch_version,
                "batch_size": self.batch_size, "created_at": _iso(self.created_at)}


@dataclass(kw_only=True, slots=True, frozen=True)
class PlanRecord:
    """A stored plan with its key, provenance and the measurements of its current checkpoints."""

    plan_id: int
    key: PlanKey
    plan: Plan
    trace: TraceInfo
    measurements: tuple[Measurement, ...]
    created_at: datetime
    updated_at: datetime

    def to_dict(self) -> dict[str, Any]:
        return {"plan_id": self.plan_id, "key": self.key.to_dict(), "plan": self.plan.to_dict(),
                "trace": self.trace.to_dict(), "measurements": [m.to_dict() for m in self.measurements],
                "created_at": _iso(self.created_at), "updated_at": _iso(self.updated_at)}


@dataclass(kw_only=True, slots=True, frozen=True)
class JobRecord:
    """A profiling job as stored."""

    id: str
    state: str
    progress: float
    message: str | None
    error: str | None
    request: Mapping[str, Any]
    result: Mapping[str, Any] | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "state": self.state, "progress": self.progress, "message": self.message,
                "error": self.error, "request": dict(self.request),
                "result": dict(self.result) if self.result is not None else None,
                "created_at": _iso(self.created_at), "updated_at": _iso(self.updated_at),
                "started_at": _iso(self.started_at), "finished_at": _iso(self.finished_at)}
