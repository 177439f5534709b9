"""A zoo run: which models a filter selects, and one summary row per model, however it was produced.

``remat-client zoo torchvision --filter 'resnet*'`` plans a whole model zoo — in this process one model after
another (the local planner's ``plan_zoo``, remat.client.local_planner), or as one batch of service jobs
(``POST /v1/zoo``). Both end in the same table, and the service's ``GET /v1/zoo/{id}`` reports the same rows:
``ZooRow`` is the one definition of a zoo result, built from a ``ModelReport`` (the plans of one model with
their measurements) or from a failure's reason.

Selecting models needs torchvision's registry; summarising needs no torch.

Public API::

    ZOOS                                                  # ("torchvision",)
    select_models(zoo, pattern=None) -> list[str]         # classification models matching a glob, registry order
    ZooRow.from_report(report) / ZooRow.failed(model, reason) / ZooRow.from_job(model, job)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from remat.client.errors import UnknownModelError
from remat.client.job_state import JobState
from remat.client.report import ModelReport
from remat.client.request import ModelRequest

__all__ = ["ROW_STATUSES", "ZOOS", "ZooRow", "select_models"]

ZOOS = ("torchvision",)
ROW_STATUSES = ("planned", "stored", "failed")
"""``planned``: profiled, planned and measured now; ``stored``: answered from stored plans; ``failed``."""
REFERENCE_ALGORITHM = "linear"
"""The plan a zoo row reports beside no checkpointing: the minimum-peak plan of the PyTorch-faithful model."""


def select_models(zoo: str, pattern: str | None = None) -> list[str]:
    """The zoo's classification models whose name matches the glob ``pattern`` (all when None).

    Raises:
        UnknownModelError: an unknown zoo, or a pattern that matches no model (the message says so).
    """
    if zoo not in ZOOS:
        raise UnknownModelError(f"zoo: unknown zoo {zoo!r}; known: {', '.join(ZOOS)}")
    import torchvision

    names = list(torchvision.models.list_models(module=torchvision.models))
    if pattern is None:
        return names
    patterns = [p.strip() for p in pattern.split(",") if p.strip()]
    chosen = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    if not chosen:
        raise UnknownModelError(f"filter: {pattern!r} matches none of the {len(names)} {zoo} classification "
                                f"models (a glob such as 'resnet*'; several separated by commas)")
    return chosen


@dataclass(frozen=True, kw_only=True)
class ZooRow:
    """One model of a zoo run: the saving of the reference plan against no checkpointing, or why it failed."""

    model: str
    """Canonical zoo name, ``torchvision:resnet50``."""
    status: str
    input_shape: tuple[int, ...] | None = None
    """Full input shape, batch included."""
    num_stages: int | None = None
    none_peak_bytes: int | None = None
    """Measured activation peak without checkpointing."""
    linear_peak_bytes: int | None = None
    """Measured activation peak of the ``linear`` plan."""
    saving: float | None = None
    """1 - linear / none, measured."""
    overhead: float | None = None
    """Step time of the ``linear`` plan against none, minus 1 (the recompute overhead)."""
    prediction_error: float | None = None
    """(predicted - measured) / measured for the ``linear`` plan."""
    grad_check_passed: bool | None = None
    """Whether every validated plan's gradients equal the unmodified step's."""
    reason: str | None = None
    """Why it failed (one line), for ``failed`` rows."""

    @classmethod
    def from_report(cls, report: ModelReport) -> ZooRow:
        """The row of one model's ``ModelReport``."""
        base, ref = report.row("none"), report.row(REFERENCE_ALGORITHM)
        none_peak = base.measured_peak_bytes if base else None
        ref_peak = ref.measured_peak_bytes if ref else None
        saving = 1 - ref_peak / none_peak if none_peak and ref_peak is not None else None
        overhead = (ref.step_ms / base.step_ms - 1 if base and ref and base.step_ms and ref.step_ms is not None
                    else None)
        error = ((ref.plan.predicted_peak_bytes - ref_peak) / ref_peak if ref and ref_peak else None)
        checks = [r.grad_check_passed for r in report.rows]
        grad_ok = None if any(c is None for c in checks) or not checks else all(checks)
        return cls(model=report.request.name, status="stored" if report.from_store else "planned",
                   input_shape=tuple(report.request.input_shape), num_stages=report.num_stages,
                   none_peak_bytes=none_peak, linear_peak_bytes=ref_peak, saving=saving, overhead=overhead,
                   prediction_error=error, grad_check_passed=grad_ok)

    @classmethod
    def failed(cls, model: str, reason: str, input_shape: Sequence[int] | None = None) -> ZooRow:
        return cls(model=model, status="failed", reason=" ".join(reason.split())[:500],
                   input_shape=tuple(input_shape) if input_shape is not None else None)

    @classmethod
    def from_job(cls, job: Mapping[str, Any]) -> ZooRow | None:
        """The row of a finished service job (``GET /v1/jobs/{id}``); None while it has not finished."""
        request = ModelRequest.from_dict(job["request"])
        if job["state"] == JobState.FAILED:
            return cls.failed(request.name, job.get("error") or "failed", request.input_shape)
        if job["state"] != JobState.SUCCEEDED or not job.get("result"):
            return None
        return cls.from_report(ModelReport.from_job(dict(job)))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["input_shape"] = list(self.input_shape) if self.input_shape is not None else None
        return out

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> ZooRow:
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in obj.items() if k in names}
        if values.get("input_shape") is not None:
            values["input_shape"] = tuple(values["input_shape"])
        return cls(**values)
