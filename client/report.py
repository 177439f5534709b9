"""What one model's planning produced, wherever it ran: every algorithm's plan beside its measurement.

``ModelReport`` is what ``remat-client plan MODEL`` prints, what a finished service job's result reads back as
(``from_job``) and what a zoo row summarises (remat.client.zoo_batch). Plain data: no torch, no database.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from remat.client.measurement import Measurement, within_noise
from remat.client.plan import Plan
from remat.client.plan_key import PlanKey
from remat.client.request import ModelRequest
from remat.client.trace import Trace

__all__ = ["BASELINE_ALGORITHM", "MaxBatchReport", "ModelReport", "PlanRow", "ProfileResult", "Trade"]

BASELINE_ALGORITHM = "none"
"""The registered planner that checkpoints nothing: what every saving and overhead is measured against."""


@dataclass(kw_only=True)
class PlanRow:
    """One algorithm's plan beside what a real training step measured with it."""

    plan: Plan
    measured_peak_bytes: int | None
    step_ms: float | None
    step_spread_ms: float | None = None
    """The step time's spread over its timed rounds (``Measurement.step_spread_ms``)."""
    grad_check_passed: bool | None = None
    """Whether the plan's gradients equalled the unmodified step's (None: not checked)."""
    timeline: dict[str, Any] | None = None
    """Memory over the measured step (``Measurement.extra["timeline"]``), None when stored before timelines were."""

    @classmethod
    def from_measurement(cls, plan: Plan, m: Measurement | None) -> PlanRow:
        """The row of ``plan`` measured by ``m`` (None: not measured)."""
        return cls(plan=plan, measured_peak_bytes=m.measured_peak_bytes if m else None,
                   step_ms=m.step_ms if m else None, step_spread_ms=m.step_spread_ms if m else None,
                   grad_check_passed=m.grad_check_passed if m else None,
                   timeline=(m.extra or {}).get("timeline") if m else None)


@dataclass(frozen=True, slots=True)
class Trade:
    """What one plan trades against no checkpointing, as measured: the one definition of saving, step-time
    overhead and prediction error for a zoo row (remat.client.zoo_batch) and the service's web pages."""

    saving: float | None
    """1 - plan's measured peak / no checkpointing's."""
    overhead: float | None
    """The plan's measured step time / no checkpointing's, minus 1 (the recompute overhead)."""
    prediction_error: float | None
    """(predicted - measured) / measured peak of the plan."""
    within_noise: bool = False
    """The two step times differ by no more than the larger of their spreads: the overhead is not told apart
    from zero, and tables say so instead of printing a percentage (a checkpointed plan "faster" than none)."""

    @classmethod
    def of(cls, base: PlanRow | None, chosen: PlanRow | None) -> Trade:
        """``chosen`` against ``base`` (the ``none`` row); None for each figure a missing measurement hides."""
        none_peak = base.measured_peak_bytes if base else None
        peak = chosen.measured_peak_bytes if chosen else None
        saving = 1 - peak / none_peak if none_peak and peak is not None else None
        overhead = (chosen.step_ms / base.step_ms - 1
                    if base and chosen and base.step_ms and chosen.step_ms is not None else None)
        error = (chosen.plan.predicted_peak_bytes - peak) / peak if chosen and peak else None
        within = (overhead is not None and chosen is not base
                  and within_noise(chosen.step_ms if chosen else None, chosen.step_spread_ms if chosen else None,
                                   base.step_ms if base else None, base.step_spread_ms if base else None))
        return cls(saving=saving, overhead=overhead, prediction_error=error, within_noise=within)


@dataclass(kw_only=True)
class ModelReport:
    """Every algorithm's plan for one request, with measurements, and where the answer came from."""

    request: ModelRequest
    key: dict[str, Any]
    num_stages: int
    rows: list[PlanRow] = field(default_factory=list)
    """One per registered planner (plans without a budget)."""
    frontier: list[PlanRow] = field(default_factory=list)
    """The Pareto frontier of (peak, recompute time), tightest peak first: ``budget`` plans, each stored
    under its own peak; a handful are measured (docs/cost-model.md, "Budgets")."""
    from_store: bool = False
    device_name: str | None = None
    derived_from: tuple[int, ...] = ()
    """The sizes of the profiles the trace was derived from (remat.client.derived_trace): batch sizes, or
    sequence lengths where :attr:`derived_along` says so; empty when the model was profiled at this shape."""
    derived_along: str | None = None
    """``batch`` or ``seq_len``: what :attr:`derived_from` counts; None for a profile."""

    def row(self, algorithm: str) -> PlanRow | None:
        return next((r for r in self.rows if r.plan.algorithm == algorithm), None)

    def to_dict(self) -> dict[str, Any]:
        base = self.row(BASELINE_ALGORITHM)
        out: dict[str, Any] = {
            "model": self.request.name, "key": self.key, "num_stages": self.num_stages,
            "from_store": self.from_store, "device_name": self.device_name,
            "derived_from": list(self.derived_from), "derived_along": self.derived_along, "plans": [],
        }
        for rows, name in ((self.rows, "plans"), (self.frontier, "frontier")):
            if name == "frontier" and not rows:
                continue
            out[name] = []
            for r in rows:
                entry = r.plan.to_dict()
                entry["key"] = self.key  # so that apply() can refuse the plan for another model, input or torch
                entry.update(measured_peak_bytes=r.measured_peak_bytes, step_ms=r.step_ms,
                             baseline_measured_peak_bytes=base.measured_peak_bytes if base else None,
                             baseline_step_ms=base.step_ms if base else None)
                out[name].append(entry)
        return out

    @classmethod
    def from_measured(cls, request: ModelRequest, key: dict[str, Any], plans: list[Plan],
                      measurements: dict[str, Measurement], *, from_store: bool,
                      device_name: str | None) -> ModelReport:
        report = cls(request=request, key=key, num_stages=plans[0].num_stages if plans else 0,
                     from_store=from_store, device_name=device_name)
        for plan in plans:
            row = PlanRow.from_measurement(plan, measurements.get(plan.label))
            (report.frontier if plan.budget_bytes else report.rows).append(row)
        report.frontier.sort(key=lambda r: r.plan.predicted_peak_bytes)
        return report


    @classmethod
    def from_job(cls, job: dict[str, Any]) -> ModelReport:
        """The report of a finished profiling job of the service (``GET /v1/jobs/{id}``'s ``result``)."""
        result = job["result"]
        entries = [*result["plans"], *result.get("frontier", [])]
        plans = [Plan.from_dict(e["plan"]) for e in entries]
        measurements = {plan.label: Measurement.from_dict(e["measurement"])
                        for plan, e in zip(plans, entries, strict=True) if e.get("measurement")}
        return cls.from_measured(ModelRequest.from_dict(job["request"]), dict(result["key"]), plans, measurements,
                                 from_store=bool(result.get("reused")), device_name=result.get("device_name"))


@dataclass(frozen=True)
class ProfileResult:
    """Everything one profiling run produced, ready to be stored in one transaction."""

    request: ModelRequest
    key: PlanKey
    trace: Trace
    plans: tuple[Plan, ...]
    measurements: Mapping[str, Measurement] = field(default_factory=dict)
    """One measurement per algorithm (empty when not validated)."""

    @property
    def device_name(self) -> str | None:
        return self.trace.metadata.get("device_name")


@dataclass(frozen=True)
class MaxBatchReport:
    """``remat-client max-batch``: the largest batch whose best plan fits, verified by a measured step."""

    request: ModelRequest
    """The request at the answer's batch size."""
    batch_size: int
    plan: Plan
    limit_bytes: int
    """The activation memory available at ``batch_size`` (the limit, or the device's room less the batch)."""
    measured: Measurement
    """The training step at ``batch_size`` with ``plan``."""
    next_plan: Plan | None
    """The best plan at ``batch_size + 1``, predicted over ``next_limit_bytes``."""
    next_limit_bytes: int | None
    profiled_batches: tuple[int, ...]
    """The batch sizes profiled (or found in the store) to derive every other one from."""
    fit_summary: str
    """What the fit says of the profiles (remat.client.derived_trace.SizeFit.describe)."""
    stepped_back: int = 0
    """Steps back from a batch predicted to fit whose step measured over the limit or ran out of memory."""
    overhead: float | None = None
    out_of_memory_batch: int | None = None
    """The least batch whose verifying step ran out of device memory (None: none did). Then ``next_plan`` may
    be predicted to fit: the caching allocator's fragmentation is outside the prediction."""
    graph_plans_note: str | None = None
    """Why graph plans (``acg``) were not searched at every batch (None: they were, beside the chain plans)."""

    @property
    def recompute_extrapolates(self) -> bool:
        """Whether the derived trace's times say anything at the answer's batch: not on cuda, where stage times
        profiled at small batches are kernel-launch bound and nearly constant in the batch (measured on an
        H100: ResNet-152's recompute came out at 944% of the step at batch 2,481; docs/benchmarks.md)."""
        return self.request.device != "cuda"

    def to_dict(self) -> dict[str, Any]:
        m = self.measured
        return {"model": self.request.name, "batch_size": self.batch_size,
                "input_shape": list(self.request.input_shape), "device": self.request.device,
                "limit_bytes": self.limit_bytes, "overhead": self.overhead,
                "plan": self.plan.to_dict(), "predicted_peak_bytes": self.plan.predicted_peak_bytes,
                "measured_peak_bytes": m.measured_peak_bytes, "step_ms": m.step_ms,
                "recompute_ms": self.plan.recompute_ms if self.recompute_extrapolates else None,
                "next": None if self.next_plan is None else {
                    "batch_size": self.batch_size + 1, "plan": self.next_plan.to_dict(),
                    "predicted_peak_bytes": self.next_plan.predicted_peak_bytes,
                    "limit_bytes": self.next_limit_bytes},
                "profiled_batches": list(self.profiled_batches), "fit": self.fit_summary,
                "stepped_back": self.stepped_back, "out_of_memory_batch": self.out_of_memory_batch,
                "graph_plans_not_searched": self.graph_plans_note}
