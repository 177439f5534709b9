"""What a page shows, from the repository's records: a key's plans beside their measurements and a job's
subject and report. Built from the product's own definitions (``PlanRecord``, ``client.report.PlanRow`` and
``Trade``, ``ModelReport.from_job``), so a page says what ``remat-client show`` and ``status`` say."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from remat.client.errors import RematError
from remat.client.measurement import Measurement
from remat.client.plan_key import PlanKey
from remat.client.report import BASELINE_ALGORITHM, ModelReport, PlanRow, Trade
from remat.client.request import ModelRequest
from remat.service.records import JobRecord, PlanRecord, TraceInfo

__all__ = ["KeyPage", "PlanLine", "job_report", "job_subject", "key_page"]


@dataclass(frozen=True, kw_only=True)
class PlanLine:
    """One plan of a key's page: the stored plan, its newest measurement, and what it trades against none."""

    record: PlanRecord
    row: PlanRow
    measurement: Measurement | None
    trade: Trade
    has_timeline: bool


@dataclass(frozen=True, kw_only=True)
class KeyPage:
    key: PlanKey
    model: str | None
    trace: TraceInfo
    """The newest trace any of the key's plans was computed from."""
    num_stages: int
    plans: tuple[PlanLine, ...]
    """One per registered planner stored, ``none`` first."""
    frontier: tuple[PlanLine, ...]
    """The newest trace's Pareto frontier, tightest peak first."""

    @property
    def timeline_algorithms(self) -> list[str]:
        return [line.record.plan.algorithm for line in self.plans if line.has_timeline]

    @property
    def measured_frontier(self) -> int:
        return sum(1 for line in self.frontier if line.measurement is not None)


def _line(record: PlanRecord, base: PlanRow | None) -> PlanLine:
    measurement = record.measurements[0] if record.measurements else None
    row = PlanRow.from_measurement(record.plan, measurement)
    return PlanLine(record=record, row=row, measurement=measurement,
                    trade=Trade.of(base, row),
                    has_timeline=record.timeline_measurement is not None)


def key_page(records: Sequence[PlanRecord], frontier: Sequence[PlanRecord]) -> KeyPage | None:
    """The page of one key from ``repository.find_plans`` and ``find_frontier``; None when nothing is stored."""
    registered = sorted((r for r in records if not r.plan.budget_bytes),
                        key=lambda r: (r.plan.algorithm != BASELINE_ALGORITHM, r.plan.algorithm))
    if not registered and not frontier:
        return None
    base_record = next((r for r in registered if r.plan.algorithm == BASELINE_ALGORITHM), None)
    base = (PlanRow.from_measurement(base_record.plan, base_record.measurements[0])
            if base_record is not None and base_record.measurements else None)
    newest = max([*registered, *frontier], key=lambda r: r.trace.trace_id)
    return KeyPage(key=newest.key, model=newest.trace.model, trace=newest.trace, num_stages=newest.plan.num_stages,
                   plans=tuple(_line(r, base) for r in registered), frontier=tuple(_line(r, base) for r in frontier))


def job_subject(job: JobRecord) -> str:
    """What a job works on, in a few words: ``torchvision:resnet50 [2, 3, 64, 64]`` or ``trace 12: cubic``."""
    request = job.request
    if job.kind == "plan":
        algorithms = ", ".join(str(a) for a in request.get("algorithms") or ())
        return f"trace {request.get('trace_id')}: {algorithms or 'plans'}"
    shape = request.get("input_shape")
    batch = request.get("batch_size")
    size = f" [{batch}, {', '.join(str(d) for d in shape)}]" if isinstance(shape, list) and batch else ""
    return f"{request.get('model', '?')}{size}"


def job_report(job: JobRecord) -> ModelReport | None:
    """A succeeded profiling job's plans with their measurements (``remat-client status``'s table); None for
    another job or a result that does not read as one (a job stored by an older worker)."""
    if job.kind != "profile" or job.result is None or not job.result.get("plans"):
        return None
    try:
        ModelRequest.from_dict(job.request)
        return ModelReport.from_job(job.to_dict())
    except (RematError, KeyError, TypeError, ValueError):
        return None
