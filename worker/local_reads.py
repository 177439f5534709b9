"""The local plan store read as answers: complete stored answers, plans for a held model's key, and reports.

The read half of the local mode (``remat.worker.local`` runs the pipeline and stores; it re-exports these
for the client's ``LocalPlanner`` port). Every read here works without torch: a repeated ``remat-client plan
resnet152`` is answered by name from the store, and whether a stored answer is complete is the workers' rule
too (``repository.newest_complete``). Reads never create a database, and an image with torch alone (no
service libraries) simply has no store.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from remat.client.devices import DEVICES
from remat.client.errors import RematError
from remat.client.plan import Plan
from remat.client.plan_key import UNKNOWN, PlanKey, current_torch_version
from remat.client.report import ModelReport, PlanRow
from remat.client.request import ModelRequest

if TYPE_CHECKING:
    from remat.service.records import PlanRecord
    from remat.service.store import PlanStore

__all__ = ["by_name", "cached_report", "existing_store", "key_like", "open_store", "report_from_records",
           "stored_frontier", "stored_plan", "stored_reports", "with_key"]


def open_store() -> PlanStore:
    from remat.service.store import PlanStore

    return PlanStore().open()


def existing_store() -> PlanStore | None:
    """The local store when there is one: never creates a database, and an image without the service's
    libraries (torch alone) has none."""
    try:
        from remat.service.config import ServiceSettings
        from remat.service.store import PlanStore
    except ImportError:
        return None
    settings = ServiceSettings()
    url = settings.database_url
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        return None
    return PlanStore(settings=settings)


def by_name(request: ModelRequest) -> bool:
    """Only a zoo name without builder arguments stands for one architecture: anything else is found by the
    key of the built model."""
    return request.source in ("torchvision", "timm", "hf") and not request.model_kwargs


def key_like(request: ModelRequest, *, torch_version: str = UNKNOWN) -> PlanKey:
    """A key with ``request``'s input, precision, device, gradients and mode; its hash is a placeholder (the
    lookups by name or hash prefix do not read it)."""
    return PlanKey(model_hash=UNKNOWN, input_shape=request.input_shape, inputs=request.call_signature,
                   dtype=request.dtype, mode=request.mode, grads=request.grads, device=request.device,
                   torch_version=torch_version)


def report_from_records(request: ModelRequest, records: Sequence[PlanRecord]) -> ModelReport:
    """A complete stored answer (``newest_complete``'s records) as a report: every planner's plan in registry
    order, then the frontier."""
    from remat.client.planning.planners import PLANNERS

    by_algorithm = {r.plan.algorithm: r for r in records if r.plan.algorithm in PLANNERS and not r.plan.budget_bytes}
    frontier = [r for r in records if r.plan.budget_bytes]
    first = by_algorithm[next(iter(PLANNERS))]
    return ModelReport.from_measured(
        request, first.key.to_dict(), [by_algorithm[name].plan for name in PLANNERS] + [r.plan for r in frontier],
        {r.plan.label: r.measurements[0] for r in [*by_algorithm.values(), *frontier] if r.measurements},
        from_store=True, device_name=first.trace.device_name)  # the repository lists measurements newest first


def cached_report(request: ModelRequest) -> ModelReport | None:
    """The stored complete answer for a zoo request, found by name: never imports torch."""
    from remat.service.repository import newest_complete

    if not by_name(request):
        return None
    with open_store() as store:
        records = store.find_plans_by_name(request.name, key_like(request, torch_version=current_torch_version()))
    complete = newest_complete(records)
    return report_from_records(request, complete) if complete is not None else None


def with_key(record: PlanRecord) -> Plan:
    return Plan.from_dict({**record.plan.to_dict(), "key": record.key.to_dict()})


def stored_plan(key: PlanKey, algorithm: str) -> Plan | None:
    """The local plan store's ``algorithm`` plan for ``key`` (a Plan carrying its key), or None (no such plan,
    or no store: one is never created here)."""
    store = existing_store()
    if store is None:
        return None
    with store:
        record = store.get_plan(key, algorithm=algorithm)
    return with_key(record) if record is not None else None


def stored_frontier(key: PlanKey) -> list[Plan]:
    """The local plan store's Pareto frontier for ``key`` (Plans carrying their key), tightest first; [] when
    none is stored or there is no store."""
    store = existing_store()
    if store is None:
        return []
    with store:
        return [with_key(r) for r in store.find_frontier(key)]


# --- remat-client show ----------------------------------------------------------------------------------

def stored_reports(*, request: ModelRequest | None = None, model_hash: str | None = None) -> list[ModelReport]:
    """What the local store holds, whatever was measured: for ``request``'s key (a zoo name is found by name,
    without torch; any other model is built to compute its key), or for every key whose architecture hash
    starts with ``model_hash``. One report per key, from its newest trace; newest key first."""
    if (request is None) == (model_hash is None):
        raise ValueError("stored_reports: give request or model_hash")
    with open_store() as store:
        if model_hash is not None:
            records = store.find_plans_by_hash_prefix(model_hash)
        elif by_name(request):
            records = store.find_plans_by_name(request.name, key_like(request))
        else:
            from remat.client.graph.built_model import build

            records = store.find_plan_records(build(request).key)
    by_key: dict[PlanKey, list[PlanRecord]] = {}
    for record in records:
        by_key.setdefault(record.key, []).append(record)
    reports = []
    for key, group in by_key.items():
        newest = max(group, key=lambda r: r.updated_at)
        rows = [r for r in group if r.trace.trace_id == newest.trace.trace_id]
        rows.sort(key=lambda r: _algorithm_order(r.plan.algorithm))
        shown = request or _request_of(key, newest.trace.model)
        report = ModelReport(request=shown, key=key.to_dict(), num_stages=rows[0].plan.num_stages,
                             from_store=True, device_name=newest.trace.device_name)
        for r in rows:
            row = PlanRow.from_measurement(with_key(r), r.measurements[0] if r.measurements else None)
            (report.frontier if r.plan.budget_bytes else report.rows).append(row)
        report.frontier.sort(key=lambda row: row.plan.predicted_peak_bytes)
        reports.append((newest.updated_at, report))
    return [report for _, report in sorted(reports, key=lambda pair: pair[0], reverse=True)]


def _algorithm_order(name: str) -> int:
    from remat.client.planning.planners import PLANNERS

    names = list(PLANNERS)
    return names.index(name) if name in names else len(names)


def _request_of(key: PlanKey, model: str | None) -> ModelRequest:
    """A request that describes a stored key (for display: the model's stored name and the key's input)."""
    try:
        spec = model or "custom:unknown"
        return ModelRequest(spec=spec, batch_size=key.input_shape[0], sample_shape=key.input_shape[1:] or (1,),
                            device=key.device if key.device in DEVICES else "cpu", grads=key.grads,
                            dtype=key.dtype if key.dtype != "unknown" else "float32", mode=key.mode)
    except RematError:
        return ModelRequest(spec="custom:unknown", batch_size=1, sample_shape=(1,))

