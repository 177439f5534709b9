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

import gc
from collections.abc import Callable, Iterable
from typing import Any

from remat.client.errors import ModelError, RematError
from remat.client.measurement import Measurement
from remat.client.plan import Plan
from remat.client.report import ModelReport, PlanRow
from remat.client.request import (  # noqa: F401  (re-exported: the CLI's defaults)
    DEFAULT_CPU_BATCH,
    DEFAULT_CPU_RESOLUTION,
    DEFAULT_CUDA_BATCH,
    ModelRequest,
    default_request,
)
from remat.client.zoo_batch import ZooRow

__all__ = ["ModelReport", "PlanRow", "cached_report", "measure_algorithm", "plan_held_model", "plan_zoo",
           "profile_and_plan", "profile_trace", "stored_plan", "stored_reports"]


def _open_store() -> Any:
    from remat.service.store import PlanStore

    return PlanStore().open()


def cached_report(request: ModelRequest) -> ModelReport | None:
    """The stored answer for ``request``, when every algorithm has a measured plan; never imports torch.

    Only a zoo name without builder arguments stands for one architecture: a callable's or builder
    arguments' model is looked up by its key once built (``profile_and_plan``).
    """
    from remat.client.plan_key import current_torch_version
    from remat.service import repository

    if request.source not in ("torchvision", "timm") or request.model_kwargs:
        return None
    store = _open_store()
    try:
        with store.db.read_session() as session:
            records, _ = repository.list_plans(session=session, model=request.name, device=request.device,
                                               dtype=request.dtype, limit=10_000, include_frontier=True)
    finally:
        store.close()
    torch_version = current_torch_version()
    matching = [r for r in records
                if r.key.input_shape == request.input_shape and r.key.grads == request.grads
                and r.key.mode == request.mode and r.key.torch_version == torch_version]
    if not matching:
        return None
    return _report_from_records(request, matching)


def _report_from_records(request: ModelRequest, records: list[Any]) -> ModelReport | None:
    """The newest trace's plans as a report, when every algorithm has a measured plan."""
    from remat.client.planning.planners import PLANNERS

    if not records:
        return None
    newest_trace = max(records, key=lambda r: r.updated_at).trace.trace_id
    by_algorithm = {r.plan.algorithm: r for r in records  # budget plans are one per budget: not in this set
                    if r.trace.trace_id == newest_trace and r.plan.algorithm in PLANNERS and not r.plan.budget_bytes}
    if set(by_algorithm) != set(PLANNERS) or not all(r.measurements for r in by_algorithm.values()):
        return None
    first = next(iter(by_algorithm.values()))
    frontier = [r for r in records if r.trace.trace_id == newest_trace and r.plan.budget_bytes]
    return ModelReport.from_measured(
        request, first.key.to_dict(), [by_algorithm[name].plan for name in PLANNERS] + [r.plan for r in frontier],
        {r.plan.label: r.measurements[0] for r in [*by_algorithm.values(), *frontier] if r.measurements},
        from_store=True, device_name=first.trace.device_name)  # the repository lists measurements newest first


class _AlreadyStored(Exception):
    def __init__(self, report: ModelReport) -> None:
        self.report = report


def profile_and_plan(request: ModelRequest, progress: Any = None, *, refresh: bool = False) -> ModelReport:
    """Run the pipeline here and store its trace, plans and measurements in one transaction.

    Once the model is built its key is looked up (unless ``refresh``): a model the name lookup cannot
    answer for (a callable, builder arguments) is profiled only once per architecture too.
    """
    from remat.worker import pipeline

    def on_key(key: Any) -> None:
        if refresh:
            return
        store = _open_store()
        try:
            report = _report_from_records(request, store.find_plan_records(key))
        finally:
            store.close()
        if report is not None:
            raise _AlreadyStored(report)

    try:
        result = pipeline.run(request, progress=progress, on_key=on_key)
    except _AlreadyStored as stored:
        return stored.report
    store = _open_store()
    try:
        key = store.save_profile(result.trace, result.plans, result.measurements)
    finally:
        store.close()
    return ModelReport.from_measured(request, key.to_dict(), list(result.plans), dict(result.measurements),
                                     from_store=False, device_name=result.device_name)


def budget_report(request: ModelRequest, budget: Any, progress: Any = None, *, refresh: bool = False) -> ModelReport:
    """``plan MODEL --budget X``: the least-recompute plan that fits, measured, beside none and linear.

    The model's full report comes first (from the store, or profiled and measured now) with its stored
    Pareto frontier; the budget picks the frontier plan with the largest peak that fits (stored under that
    peak, so every budget it answers finds it), and measures it with a real step if no profiling run did.

    Args:
        budget: a :class:`remat.client.budget_spec.BudgetSpec`.

    Raises:
        remat.client.budget_spec.BudgetInfeasibleError: no plan fits (names the smallest feasible peak).
        remat.client.budget_spec.BudgetError: ``fit`` without a CUDA device.
    """
    from remat.client.budget_spec import pick_for_budget
    from remat.client.plan import BUDGET_ALGORITHM
    from remat.client.plan_key import PlanKey
    from remat.client.planning.plans import frontier_plans
    from remat.worker.pipeline import fit_bytes_for

    report = None if refresh else cached_report(request)
    if report is None:
        report = profile_and_plan(request, progress, refresh=refresh)
    key = PlanKey.from_dict(report.key)
    none_row, linear_row = report.row("none"), report.row("linear")
    assert none_row is not None and linear_row is not None  # a full report has every registered planner
    fit_bytes = fit_bytes_for(request) if budget.fit else None
    budget_bytes = budget.resolve(baseline_peak_bytes=none_row.plan.predicted_peak_bytes, fit_bytes=fit_bytes)
    store = _open_store()
    try:
        trace = None
        frontier = report.frontier
        if not frontier:  # stored before frontiers were: compute and keep it now
            trace = _stored_trace(store, key)
            plans = frontier_plans(trace)
            store.save_profile(trace, plans, {})
            frontier = [PlanRow.from_measurement(p, None) for p in plans]
        row = pick_for_budget(frontier, budget_bytes, peak=lambda r: r.plan.predicted_peak_bytes)
        if row.measured_peak_bytes is None:
            from remat.worker import pipeline

            trace = trace or _stored_trace(store, key)
            built = pipeline.build(request)
            measured = pipeline.validate(built, trace, [none_row.plan, row.plan], progress=progress,
                                         timing_rounds=1)[row.plan.label]
            store.save_measurement(key, measured, algorithm=BUDGET_ALGORITHM, budget_bytes=row.plan.budget_bytes)
            row = PlanRow.from_measurement(row.plan, measured)
    finally:
        store.close()
    out = ModelReport(request=request, key=report.key, num_stages=report.num_stages, from_store=report.from_store,
                      device_name=report.device_name)
    out.rows.extend([none_row, linear_row, row])
    return out


def _stored_trace(store: Any, key: Any) -> Any:
    records = store.find_plan_records(key)
    return store.load_trace(max(records, key=lambda r: r.updated_at).trace.trace_id)


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


def _reason(exc: BaseException) -> str:
    if isinstance(exc, RematError):
        return str(exc)
    first = (str(exc).splitlines() or [""])[0]
    return f"internal error ({type(exc).__name__}: {first})"


def plan_zoo(requests: Iterable[ModelRequest], *, refresh: bool = False,
             on_start: Callable[[ModelRequest], None] | None = None,
             on_row: Callable[[ZooRow], None] | None = None,
             progress: Callable[[str, float], None] | None = None) -> list[ZooRow]:
    """``remat-client zoo`` without a server: plan every request here, one after another, storing each model's
    result as it finishes; returns a ``ZooRow`` per request.

    A model already in the local plan store is answered from it (``refresh`` profiles it again). A model that
    fails becomes a ``failed`` row with its reason and the run goes on. A KeyboardInterrupt propagates after
    the model that was running; everything finished before it is stored, so the same command resumes.
    """
    rows: list[ZooRow] = []
    for request in requests:
        if on_start is not None:
            on_start(request)
        try:
            report = None if refresh else cached_report(request)
            if report is None:
                report = profile_and_plan(request, progress=progress, refresh=refresh)
            row = ZooRow.from_report(report)
        except (KeyboardInterrupt, SystemExit):
            raise
        except ModelError as exc:
            row = ZooRow.failed(request.name, str(exc), request.input_shape)
        except Exception as exc:  # noqa: BLE001 - one model's failure must not end a zoo run; its reason is kept
            row = ZooRow.failed(request.name, _reason(exc), request.input_shape)
        finally:
            gc.collect()
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


# --- remat.client.checkpoint's steps that need the worker or the database ----------------------------------

def stored_plan(key: Any, algorithm: str) -> Any:
    """The local plan store's ``algorithm`` plan for ``key`` (a Plan carrying its key), or None.

    Never creates a database that is not there, and a machine without the service's libraries (a GPU image
    with torch alone) simply has no store: None.
    """
    from pathlib import Path

    try:
        from remat.service.config import ServiceSettings
        from remat.service.store import PlanStore
    except ImportError:
        return None
    settings = ServiceSettings()
    url = settings.database_url
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        return None
    store = PlanStore(settings=settings)
    try:
        record = store.get_plan(key, algorithm=algorithm)
    finally:
        store.close()
    if record is None:
        return None
    return Plan.from_dict({**record.plan.to_dict(), "key": record.key.to_dict()})


def stored_frontier(key: Any) -> list[Any]:
    """The local plan store's Pareto frontier for ``key`` (Plans carrying their key), tightest first; [] when
    none is stored or there is no store (same rules as :func:`stored_plan`)."""
    from pathlib import Path

    try:
        from remat.service import repository
        from remat.service.config import ServiceSettings
        from remat.service.store import PlanStore
    except ImportError:
        return []
    settings = ServiceSettings()
    url = settings.database_url
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        return []
    store = PlanStore(settings=settings)
    try:
        with store.db.read_session() as session:
            records = repository.find_frontier(session=session, key=key)
    finally:
        store.close()
    return [Plan.from_dict({**r.plan.to_dict(), "key": r.key.to_dict()}) for r in records]


def plan_held_model(built: Any, algorithm: str, progress: Any = None, *, budget: Any = None) -> Any:
    """Profile a model the caller holds, plan it with every algorithm and its frontier, measure ``none`` and
    ``algorithm``'s plan — or, with ``budget``, the frontier plan it picks — (one training step each,
    gradient-checked) and store it all in the local plan store when there is one.

    Only two plans are measured: this runs inside someone's training job, where every step counts; the
    other plans are stored unmeasured (``remat-client plan`` measures them all).

    Args:
        budget: a :class:`remat.client.budget_spec.BudgetSpec` in bytes or a share of this trace's
            no-checkpoint peak (the caller turns ``fit`` into bytes: it knows the device).

    Returns:
        ``(result, chosen)``: ``remat.worker.pipeline.ProfileResult`` and the plan to apply. A store that
        refuses the result is a warning, not an error.

    Raises:
        remat.client.budget_spec.BudgetInfeasibleError: no plan fits the budget.
    """
    from remat.client.planning.plans import FRONTIER_MAX_STAGES
    from remat.worker import pipeline

    say = progress or (lambda message, fraction: None)
    say(f"profiling {built.chain.num_stages} stages", 0.1)
    trace = pipeline.profile(built)
    plans = pipeline.plans_for(built, trace, frontier=trace.num_stages <= FRONTIER_MAX_STAGES or budget is not None)
    infeasible = None
    if budget is not None:
        from remat.client.budget_spec import BudgetInfeasibleError

        try:
            chosen = pick_from_frontier([p for p in plans if p.budget_bytes], budget)
        except BudgetInfeasibleError as exc:  # raised once the profile is stored: it is still worth keeping
            chosen, infeasible = None, exc
    else:
        chosen = next((p for p in plans if p.algorithm == algorithm and not p.budget_bytes), None)
    measured = [p for p in plans if p.algorithm == "none"] + ([chosen] if chosen is not None else [])
    measurements = pipeline.validate(built, trace, measured, progress=say, start=0.5, end=0.95, timing_rounds=1)
    result = pipeline.ProfileResult(request=built.request, key=built.key, trace=trace, plans=plans,
                                    measurements=measurements)
    _keep_locally(result)
    if infeasible is not None:
        raise infeasible
    return result, chosen


def _keep_locally(result: Any) -> None:
    """Store a profile in the local plan store when there is one; a store that refuses it is a warning."""
    import warnings

    try:
        from remat.service.store import PlanStore
    except ImportError:
        return  # a machine with torch alone (a GPU image) has no store
    try:
        store = PlanStore().open()
        try:
            store.save_profile(result.trace, result.plans, result.measurements)
        finally:
            store.close()
    except Exception as exc:  # noqa: BLE001 - the plan is good; only keeping a copy here failed
        warnings.warn(f"remat: the local plan store did not take the plan ({type(exc).__name__}: {exc}); "
                      f"it is kept in the plan cache only", RuntimeWarning, stacklevel=4)


def pick_from_frontier(frontier: list[Any], budget: Any) -> Any:
    """The frontier plan answering ``budget`` (a BudgetSpec; a share resolves against the no-checkpoint peak).

    Raises:
        remat.client.budget_spec.BudgetInfeasibleError: no plan fits; it names the smallest peak.
    """
    from remat.client.budget_spec import pick_for_budget

    frontier = sorted(frontier, key=lambda p: p.predicted_peak_bytes)
    budget_bytes = budget.resolve(baseline_peak_bytes=frontier[-1].baseline_peak_bytes)
    return pick_for_budget(frontier, budget_bytes, peak=lambda p: p.predicted_peak_bytes)


# --- remat-client show ----------------------------------------------------------------------------------

MIN_HASH_PREFIX = 8


def stored_reports(*, request: ModelRequest | None = None, model_hash: str | None = None) -> list[ModelReport]:
    """What the local store holds, whatever was measured: for ``request``'s key (a zoo name is found by name,
    without torch; any other model is built to compute its key), or for every key whose architecture hash
    starts with ``model_hash``. One report per key, from its newest trace; newest key first."""
    from remat.service import repository

    if (request is None) == (model_hash is None):
        raise ValueError("stored_reports: give request or model_hash")
    store = _open_store()
    try:
        with store.db.read_session() as session:
            if model_hash is not None:
                records, _ = repository.list_plans(session=session, limit=100_000, include_frontier=True)
                records = [r for r in records if r.key.model_hash.startswith(model_hash)]
            elif request.source in ("torchvision", "timm") and not request.model_kwargs:
                records, _ = repository.list_plans(session=session, model=request.name, device=request.device,
                                                   dtype=request.dtype, limit=100_000, include_frontier=True)
                records = [r for r in records if r.key.input_shape == request.input_shape
                           and r.key.grads == request.grads and r.key.mode == request.mode]
            else:
                from remat.worker import pipeline

                key = pipeline.build(request).key
                records = repository.find_plans(session=session, key=key)
    finally:
        store.close()
    by_key: dict[Any, list[Any]] = {}
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
            row = PlanRow.from_measurement(Plan.from_dict({**r.plan.to_dict(), "key": key.to_dict()}),
                                           r.measurements[0] if r.measurements else None)  # newest first
            (report.frontier if r.plan.budget_bytes else report.rows).append(row)
        report.frontier.sort(key=lambda row: row.plan.predicted_peak_bytes)
        reports.append((newest.updated_at, report))
    return [report for _, report in sorted(reports, key=lambda pair: pair[0], reverse=True)]


def _algorithm_order(name: str) -> int:
    from remat.client.planning.planners import PLANNERS

    names = list(PLANNERS)
    return names.index(name) if name in names else len(names)


def _request_of(key: Any, model: str | None) -> ModelRequest:
    """A request that describes a stored key (for display: the model's stored name and the key's input)."""
    try:
        spec = model or "custom:unknown"
        return ModelRequest(spec=spec, batch_size=key.input_shape[0], sample_shape=key.input_shape[1:] or (1,),
                            device=key.device if key.device in ("cpu", "cuda") else "cpu", grads=key.grads,
                            dtype=key.dtype if key.dtype != "unknown" else "float32", mode=key.mode)
    except RematError:
        return ModelRequest(spec="custom:unknown", batch_size=1, sample_shape=(1,))
