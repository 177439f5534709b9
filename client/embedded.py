"""The CLI's embedded mode: the pipeline run on this machine, its result kept in the local plan store.

``remat-client plan resnet152`` runs here. The first run calls ``remat.worker.pipeline.run`` (build, profile,
plan with every algorithm, measure and gradient-check each plan) and stores trace, plans and measurements in
one transaction of the local plan database (``remat.service.store.PlanStore``: SQLite under the user's cache
directory unless ``REMAT_DATABASE_URL`` says otherwise). Later runs with the same request answer from the
store **without importing torch**: the request is matched by zoo name, input shape, precision, device class,
gradient convention and mode, and the stored plans must come from the installed torch's major.minor — the
same facts the architecture hash stands for when the zoo builds the model.

The worker and service packages are imported inside functions only: ``import remat.client`` stays light.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from remat.client.measurement import Measurement
from remat.client.plan import Plan
from remat.client.request import (  # noqa: F401  (re-exported: the CLI's defaults)
    DEFAULT_CPU_BATCH,
    DEFAULT_CPU_RESOLUTION,
    DEFAULT_CUDA_BATCH,
    ModelRequest,
    default_request,
)

__all__ = ["ModelReport", "PlanRow", "cached_report", "measure_algorithm", "profile_and_plan", "profile_trace"]


@dataclass(kw_only=True)
class PlanRow:
    """One algorithm's plan beside what a real training step measured with it."""

    plan: Plan
    measured_peak_bytes: int | None
    step_ms: float | None


@dataclass(kw_only=True)
class ModelReport:
    """Every algorithm's plan for one request, with measurements, and where the answer came from."""

    request: ModelRequest
    key: dict[str, Any]
    num_stages: int
    rows: list[PlanRow] = field(default_factory=list)
    from_store: bool = False
    device_name: str | None = None

    def row(self, algorithm: str) -> PlanRow | None:
        return next((r for r in self.rows if r.plan.algorithm == algorithm), None)

    def to_dict(self) -> dict[str, Any]:
        base = self.row("none")
        out: dict[str, Any] = {
            "model": self.request.name, "key": self.key, "num_stages": self.num_stages,
            "from_store": self.from_store, "device_name": self.device_name, "plans": [],
        }
        for r in self.rows:
            entry = r.plan.to_dict()
            entry["key"] = self.key  # so that apply() can refuse the plan for another model, input or torch
            entry.update(measured_peak_bytes=r.measured_peak_bytes, step_ms=r.step_ms,
                         baseline_measured_peak_bytes=base.measured_peak_bytes if base else None,
                         baseline_step_ms=base.step_ms if base else None)
            out["plans"].append(entry)
        return out

    @classmethod
    def from_measured(cls, request: ModelRequest, key: dict[str, Any], plans: list[Plan],
                      measurements: dict[str, Measurement], *, from_store: bool,
                      device_name: str | None) -> ModelReport:
        report = cls(request=request, key=key, num_stages=plans[0].num_stages if plans else 0,
                     from_store=from_store, device_name=device_name)
        for plan in plans:
            m = measurements.get(plan.algorithm)
            report.rows.append(PlanRow(plan=plan, measured_peak_bytes=m.measured_peak_bytes if m else None,
                                       step_ms=m.step_ms if m else None))
        return report


    @classmethod
    def from_job(cls, job: dict[str, Any]) -> ModelReport:
        """The report of a finished profiling job of the service (``GET /v1/jobs/{id}``'s ``result``)."""
        result = job["result"]
        entries = result["plans"]
        plans = [Plan.from_dict(e["plan"]) for e in entries]
        measurements = {e["plan"]["algorithm"]: Measurement.from_dict(e["measurement"])
                        for e in entries if e.get("measurement")}
        return cls.from_measured(ModelRequest.from_dict(job["request"]), dict(result["key"]), plans, measurements,
                                 from_store=bool(result.get("reused")), device_name=result.get("device_name"))


def _open_store() -> Any:
    from remat.service.store import PlanStore

    return PlanStore().open()


def cached_report(request: ModelRequest) -> ModelReport | None:
    """The stored answer for ``request``, when every algorithm has a measured plan; never imports torch."""
    from remat.client.plan_key import current_torch_version
    from remat.service import repository
    from remat.worker.planners import PLANNERS

    store = _open_store()
    try:
        with store.db.read_session() as session:
            records, _ = repository.list_plans(session=session, model=request.name, device=request.device,
                                               dtype=request.dtype, limit=10_000)
    finally:
        store.close()
    torch_version = current_torch_version()
    matching = [r for r in records
                if r.key.input_shape == request.input_shape and r.key.grads == request.grads
                and r.key.mode == request.mode and r.key.torch_version == torch_version]
    if not matching:
        return None
    newest_trace = max(matching, key=lambda r: r.updated_at).trace.trace_id
    by_algorithm = {r.plan.algorithm: r for r in matching if r.trace.trace_id == newest_trace}
    if set(by_algorithm) != set(PLANNERS) or not all(r.measurements for r in by_algorithm.values()):
        return None
    first = next(iter(by_algorithm.values()))
    return ModelReport.from_measured(
        request, first.key.to_dict(), [by_algorithm[name].plan for name in PLANNERS],
        {name: by_algorithm[name].measurements[0] for name in PLANNERS},  # the repository lists newest first
        from_store=True, device_name=first.trace.device_name)


def profile_and_plan(request: ModelRequest, progress: Any = None) -> ModelReport:
    """Run the pipeline here and store its trace, plans and measurements in one transaction."""
    from remat.worker import pipeline

    result = pipeline.run(request, progress=progress)
    store = _open_store()
    try:
        key = store.save_profile(result.trace, result.plans, result.measurements)
    finally:
        store.close()
    return ModelReport.from_measured(request, key.to_dict(), list(result.plans), dict(result.measurements),
                                     from_store=False, device_name=result.device_name)


def profile_trace(request: ModelRequest, progress: Any = None) -> Any:
    """Only the profiling step: the model's ``remat-trace/1`` trace (``remat-client trace``)."""
    from remat.worker import pipeline

    say = progress or (lambda message, fraction: None)
    say(f"building {request.name}", 0.0)
    built = pipeline.build(request)
    say(f"profiling {built.chain.num_stages} stages", 0.3)
    return pipeline.profile(built)


def measure_algorithm(request: ModelRequest, algorithm: str, progress: Any = None) -> Measurement:
    """One plan measured beside no checkpointing (``remat-client measure``)."""
    from remat.worker import pipeline

    return pipeline.measure_algorithm(request, algorithm, progress=progress)
