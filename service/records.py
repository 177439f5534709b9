"""Plain, immutable results of the repository, detached from any database session.

The repository returns these rather than ORM rows so that callers (the HTTP API, the cache, the CLI's
embedded store) can keep them after the transaction ends and turn them into JSON without lazy loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from remat.client.job_state import FINISHED_JOB_STATES, JobState
from remat.client.measurement import Measurement
from remat.client.plan import Plan
from remat.client.plan_key import PlanKey
from remat.client.report import BASELINE_ALGORITHM, Trade
from remat.client.report import PlanRow as ReportRow

__all__ = ["JobRecord", "KeySummary", "Measurement", "PlanRecord", "StoredPlans", "StoredTrace", "TraceInfo"]


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


@dataclass(kw_only=True, slots=True, frozen=True)
class StoredTrace:
    """Where ``store_trace`` put a trace."""

    trace_id: int
    key: PlanKey
    content_sha256: str
    created: bool
    """False when an identical trace was already stored (the call was a no-op)."""
    superseded_by: int | None = None
    """A newer trace of the same key, when one kept this trace's plans out (``store_profile``; NOTE [latest
    profile wins] in repository.py); None when they were written."""


@dataclass(kw_only=True, slots=True, frozen=True)
class StoredPlans:
    """What ``store_plans`` did with the plans of one trace."""

    key: PlanKey
    superseded_by: int | None = None
    """The newer trace of the same key that made this one stale: nothing was written (NOTE [latest profile
    wins] in repository.py). None when the plans were written."""


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
    derived_from: tuple[int, ...] = ()
    """The sizes of the profiles the trace was derived from (remat.client.derived_trace.derived_sizes): batch
    sizes, or sequence lengths where :attr:`derived_along` says so; empty for a profile."""
    derived_along: str | None = None
    """``batch`` or ``seq_len`` for a derived trace (derived_trace.derived_along); None for a profile."""

    def to_dict(self) -> dict[str, Any]:
        return {"trace_id": self.trace_id, "content_sha256": self.content_sha256, "model": self.model,
                "device_name": self.device_name, "torch_version": self.torch_version,
                "batch_size": self.batch_size, "derived_from": list(self.derived_from),
                "derived_along": self.derived_along,
                "created_at": _iso(self.created_at)}


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

    @property
    def derived(self) -> bool:
        """A plan of a derived trace that no measured step has validated yet (then it is an ordinary plan)."""
        return bool(self.trace.derived_from) and not self.measurements

    @property
    def timeline_measurement(self) -> Measurement | None:
        """The newest measurement that recorded memory over its step; None when every one was stored before
        timelines were recorded (``GET /v1/plans/{hash}/timeline``'s 404, the web page's missing picture)."""
        return next((m for m in self.measurements if (m.extra or {}).get("timeline")), None)

    def to_dict(self) -> dict[str, Any]:
        return {"plan_id": self.plan_id, "key": self.key.to_dict(), "plan": self.plan.to_dict(),
                "trace": self.trace.to_dict(), "derived": self.derived,
                # Timelines are served apart (GET /v1/plans/{hash}/timeline): a plan fetch stays small.
                "measurements": [m.to_dict(timelines=False) for m in self.measurements],
                "created_at": _iso(self.created_at), "updated_at": _iso(self.updated_at)}


@dataclass(kw_only=True, slots=True, frozen=True)
class KeySummary:
    """One stored plan key at a glance (the web pages' architectures table): its minimum-peak plans, each beside
    its newest measurement, and what the best of them trades against no checkpointing.

    Built from the one plan and measurement (``client.report.PlanRow``) without the measurements' timelines:
    a page of summaries reads a few hundred plans, and their timelines would be most of the bytes.
    """

    key: PlanKey
    model: str | None
    """The model name the key's trace recorded."""
    num_stages: int
    profiled_at: datetime
    """When the trace of the key's ``none`` plan was stored."""
    rows: tuple[ReportRow, ...]
    """Every registered planner's plan stored for the key (no frontier points), by algorithm."""

    def row(self, algorithm: str) -> ReportRow | None:
        return next((r for r in self.rows if r.plan.algorithm == algorithm), None)

    @property
    def baseline(self) -> ReportRow | None:
        """The ``none`` plan's row: what each saving is measured against."""
        return self.row(BASELINE_ALGORITHM)

    @property
    def best(self) -> ReportRow | None:
        """The checkpointing plan with the lowest measured peak (the faster step on a tie); None when none is
        measured."""
        measured = [r for r in self.rows
                    if r.plan.algorithm != BASELINE_ALGORITHM and r.measured_peak_bytes is not None]
        return min(measured, default=None, key=lambda r: (
            r.measured_peak_bytes, r.step_ms if r.step_ms is not None else float("inf"), r.plan.algorithm))

    @property
    def trade(self) -> Trade:
        """The best plan against no checkpointing."""
        return Trade.of(self.baseline, self.best)


@dataclass(kw_only=True, slots=True, frozen=True)
class JobRecord:
    """A profiling (or planning) job as stored; see NOTE [job lease] in models.py."""

    id: str
    state: JobState
    """A plain ``str`` from the database becomes the member here (and a misspelt state a ValueError)."""
    progress: float
    message: str | None
    error: str | None
    request: Mapping[str, Any]
    result: Mapping[str, Any] | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    kind: str = "profile"
    queue: str | None = None
    leader_id: str | None = None
    """The job this one follows (same request, one run), or None."""
    attempts: int = 0
    lease_owner: str | None = None
    lease_expires_at: datetime | None = None
    plan_key: Mapping[str, Any] | None = None
    """The plan key, once a worker has built the model."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", JobState(self.state))

    @property
    def finished(self) -> bool:
        return self.state in FINISHED_JOB_STATES

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "state": self.state.value, "progress": self.progress,
                "message": self.message, "error": self.error, "request": dict(self.request),
                "result": dict(self.result) if self.result is not None else None,
                "plan_key": dict(self.plan_key) if self.plan_key is not None else None,
                "queue": self.queue, "leader_id": self.leader_id, "attempts": self.attempts,
                "lease_owner": self.lease_owner, "lease_expires_at": _iso(self.lease_expires_at),
                "created_at": _iso(self.created_at), "updated_at": _iso(self.updated_at),
                "started_at": _iso(self.started_at), "finished_at": _iso(self.finished_at)}
