"""The local mode: the pipeline run on this machine, its result kept in the local plan store.

The Celery tasks (``remat.worker.tasks``) run the pipeline for the cluster; this module is their twin for one
machine, and the client reaches it only through its port, ``remat.client.local_planner.LocalPlanner`` (bound
by the ``remat.local_planner`` entry point to this module): ``remat-client plan MODEL`` without a server,
``trace``, ``measure``, ``zoo``, and ``remat.client.checkpoint`` when no plan is stored anywhere. What the
store already holds is read by ``remat.worker.local_reads`` (re-exported here: ``cached_report``,
``stored_plan``, ``stored_frontier``, ``stored_reports``, the rest of the port).

The first ``remat-client plan resnet152`` builds the model, looks its key up, and only then profiles, plans
with every algorithm, measures and gradient-checks each plan (``remat.worker.pipeline.run_built``), storing
trace, plans and measurements in one transaction of the local plan database (``remat.service.store.PlanStore``:
SQLite under the user's cache directory unless ``REMAT_DATABASE_URL`` says otherwise).

The service is imported inside functions only: an image with torch alone (a GPU node) still profiles and
plans here, and simply has no store.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from remat.client.budget_spec import BudgetInfeasibleError, BudgetSpec, pick_for_budget, pick_from_frontier
from remat.client.derived_trace import derived_along, derived_sizes, describe_source
from remat.client.errors import ModelError, RematError
from remat.client.measurement import Measurement
from remat.client.plan import BUDGET_ALGORITHM, Plan
from remat.client.plan_key import PlanKey
from remat.client.report import MaxBatchReport, ModelReport, PlanRow, ProfileResult
from remat.client.request import ModelRequest, ProgressFn
from remat.client.trace import Trace
from remat.client.zoo_batch import ZooRow
from remat.worker.local_reads import (
    cached_report,
    open_store,
    report_from_records,
    stored_frontier,
    stored_plan,
    stored_reports,
)

if TYPE_CHECKING:
    from remat.client.derived_trace import SizeFit
    from remat.client.graph.built_model import BuiltModel
    from remat.client.planning.graph_predict import GraphProfile
    from remat.client.planning.max_batch import GraphPlanAt
    from remat.service.store import PlanStore

__all__ = ["budget_report", "cached_report", "max_batch", "measure_algorithm", "plan_held_model", "plan_zoo", "profile",
           "profile_and_plan", "profile_trace", "stored_frontier", "stored_plan", "stored_reports"]


def _silent(message: str, fraction: float) -> None:
    return None


def profile_and_plan(request: ModelRequest, progress: ProgressFn | None = None, *,
                     refresh: bool = False) -> ModelReport:
    """Build the model, answer from the store when its key is complete there (unless ``refresh``), else run
    the pipeline here and store trace, plans and measurements in one transaction.

    The lookup by key (seconds, before minutes of profiling) answers for models the name lookup cannot: a
    callable, builder arguments.
    """
    from remat.client.graph.built_model import build
    from remat.worker import pipeline

    say = progress or _silent
    say(f"building {request.name}", 0.0)
    built = build(request)
    derived = None
    if not refresh:
        with open_store() as store:
            complete = store.complete_plans(built.key)
            if complete is None:
                derived = derive_trace(store.size_profiles(built.key), built.key)
        if complete is not None:
            return report_from_records(request, complete)
    if derived is not None:
        say(f"deriving from {describe_source(derived)}", 0.05)
        result = pipeline.run_derived(built, derived, progress=say)
    else:
        result = pipeline.run_built(built, progress=say)
    with open_store() as store:
        key = store.save_profile(result.trace, result.plans, result.measurements)
    report = ModelReport.from_measured(request, key.to_dict(), list(result.plans), dict(result.measurements),
                                       from_store=False, device_name=result.device_name)
    report.derived_from = derived_sizes(result.trace)
    report.derived_along = derived_along(result.trace)
    return report


def derive_trace(profiles: Sequence[Trace], key: PlanKey) -> Trace | None:
    """The trace at ``key``'s shape derived from stored profiles at other batch sizes (or, for a token model,
    other sequence lengths); None when there are too few, or they do not line up (then the model is profiled
    at ``key``'s shape instead, with a warning saying why)."""
    from remat.client.derived_trace import SizeFitError, derive_at

    try:
        return derive_at(profiles, key.input_shape, key.inputs)
    except SizeFitError as exc:
        warnings.warn(f"remat: profiling at input shape {list(key.input_shape)}: the stored profiles at other sizes "
                      f"cannot be lined up ({exc})", RuntimeWarning, stacklevel=2)
        return None


def budget_report(request: ModelRequest, budget: BudgetSpec, progress: ProgressFn | None = None, *,
                  refresh: bool = False) -> ModelReport:
    """``plan MODEL --budget X``: the least-recompute plan that fits, measured, beside none and linear.

    The model's full report comes first (from the store, or profiled and measured now) with its stored
    Pareto frontier; the budget picks the frontier plan with the largest peak that fits (stored under that
    peak, so every budget it answers finds it), and measures it with a real step if no profiling run did.

    Raises:
        remat.client.budget_spec.BudgetInfeasibleError: no plan fits (names the smallest feasible peak).
        remat.client.budget_spec.BudgetError: ``fit`` without a CUDA device.
    """
    from remat.client.graph.built_model import build, fit_bytes_for
    from remat.client.planning.plans import frontier_plans
    from remat.worker import pipeline

    report = None if refresh else cached_report(request)
    if report is None:
        report = profile_and_plan(request, progress, refresh=refresh)
    key = PlanKey.from_dict(report.key)
    none_row, linear_row = report.row("none"), report.row("linear")
    assert none_row is not None and linear_row is not None  # a full report has every registered planner
    fit_bytes = fit_bytes_for(request) if budget.fit else None
    budget_bytes = budget.resolve(baseline_peak_bytes=none_row.plan.predicted_peak_bytes, fit_bytes=fit_bytes)
    with open_store() as store:
        trace = None
        frontier = report.frontier
        if not frontier:  # stored before frontiers were: compute and keep it now
            trace = _stored_trace(store, key)
            plans = frontier_plans(trace)
            store.save_profile(trace, plans, {})
            frontier = [PlanRow.from_measurement(p, None) for p in plans]
        row = pick_for_budget(frontier, budget_bytes, peak=lambda r: r.plan.predicted_peak_bytes,
                              plan=lambda r: r.plan)
        if row.measured_peak_bytes is None:
            trace = trace or _stored_trace(store, key)
            built = build(request)
            if row.plan.is_graph_plan:  # a point below the chains, stored unmeasured: it runs on the op graph
                built.op_graph = pipeline.op_graph(built)
            measured = pipeline.validate(built, trace, [none_row.plan, row.plan], progress=progress,
                                         timing_rounds=1)[row.plan.label]
            store.save_measurement(key, measured, algorithm=BUDGET_ALGORITHM, budget_bytes=row.plan.budget_bytes)
            row = PlanRow.from_measurement(row.plan, measured)
    out = ModelReport(request=request, key=report.key, num_stages=report.num_stages, from_store=report.from_store,
                      device_name=report.device_name)
    out.rows.extend([none_row, linear_row, row])
    return out


def _stored_trace(store: PlanStore, key: PlanKey) -> Trace:
    records = store.find_plan_records(key)
    trace = store.load_trace(max(records, key=lambda r: r.updated_at).trace.trace_id)
    assert trace is not None  # a plan's trace is deleted only with the plan
    return trace


def profile(built: BuiltModel) -> Trace:
    """The trace of a model the caller built (``plan MODEL --server`` uploads it)."""
    from remat.worker import pipeline

    return pipeline.profile(built)


def profile_trace(request: ModelRequest, progress: ProgressFn | None = None) -> Trace:
    """Only the profiling step: the model's ``remat-trace/1`` trace (``remat-client trace``)."""
    from remat.client.graph.built_model import build

    say = progress or _silent
    say(f"building {request.name}", 0.0)
    built = build(request)
    say(f"profiling {built.chain.num_stages} stages", 0.3)
    return profile(built)


def measure_algorithm(request: ModelRequest, algorithm: str, progress: ProgressFn | None = None) -> Measurement:
    """One plan measured beside no checkpointing (``remat-client measure``)."""
    from remat.worker import pipeline

    return pipeline.measure_algorithm(request, algorithm, progress=progress)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, RematError):
        return str(exc)
    first = (str(exc).splitlines() or [""])[0]
    return f"internal error ({type(exc).__name__}: {first})"


DEFAULT_PROFILE_BATCHES = (2, 4)
"""The batch sizes ``max-batch`` profiles (or finds stored) to derive every other one from: small, so that
profiling never needs the memory whose limit is in question."""
MAX_STEP_BACKS = 3
"""Steps ``max-batch`` takes back when the measured step exceeds a limit the prediction met: one batch at a time
when it measured over, ``OOM_STEP_BACK`` of the batch when the device ran out of memory."""
OOM_STEP_BACK = 0.03
"""The share of the batch given up when the verifying step runs out of CUDA memory: the allocator's
fragmentation grows with the batch, so one sample back would rarely be enough."""


def _release_device_memory(device: str) -> None:
    """Free what the last verifying step left cached, so that the next (smaller) batch starts from an empty
    allocator, not from a fragmented one."""
    import gc

    from remat.worker.profilers import backend_for

    gc.collect()
    backend_for(device).empty_cache()


def max_batch(request: ModelRequest, memory: BudgetSpec, *, overhead: float | None = None,
              profile_batches: Sequence[int] = DEFAULT_PROFILE_BATCHES,
              progress: ProgressFn | None = None) -> MaxBatchReport:
    """The largest batch whose best plan fits ``memory``, derived from profiles at ``profile_batches`` (stored
    ones reused, missing ones profiled and stored), verified by one measured training step at that batch. On the
    CPU the graph plan is searched too, on graph profiles derived from those batches' (:func:`_graph_plan_at`).

    Raises:
        remat.client.budget_spec.BudgetError: a share of the peak (no peak to take it of), or ``fit`` off CUDA.
        remat.client.planning.max_batch.MaxBatchError: not even batch 1 fits.
    """
    from dataclasses import replace as replaced

    from remat.client.budget_spec import BudgetError
    from remat.client.derived_trace import fit_batches
    from remat.client.graph.built_model import OutOfMemoryProfiling, build, fit_bytes_for
    from remat.client.planning.max_batch import MaxBatchError, best_plan, largest_batch
    from remat.worker import pipeline

    say = progress or _silent
    if memory.fraction is not None:
        raise BudgetError(f"memory: {memory.text} is a share of a batch's peak; max-batch needs bytes (6GiB) or fit")
    if memory.fit and request.device != "cuda":  # before the profiles, not after them
        raise BudgetError("memory: fit is the CUDA device's free memory; on the CPU give a byte limit (8GiB)")
    profiles = []
    graph_profiles = []
    base: BuiltModel | None = None  # the smallest batch's model, whose op graph runs the graph search
    with open_store() as store:
        for k, batch in enumerate(sorted(set(profile_batches))):
            at_batch = replaced(request, batch_size=batch)
            say(f"profile at batch {batch}", 0.3 * k / len(profile_batches))
            built = build(at_batch)
            stored = [t for t in store.size_profiles(built.key, include_own=True)
                      if t.metadata.get("batch_size") == batch]
            if stored:
                profiles.append(stored[0])
                if overhead is None and request.device == "cpu" and stored[0].graph is not None:
                    pipeline.profile_op_graph(built)  # one instrumented step at a small batch, for graph plans
            else:
                trace = pipeline.profile(built)
                store.save_trace(trace)
                profiles.append(trace)
            graph_profiles.append(built.graph_profile)
            if base is None and built.graph_profile is not None:
                base = built
            del built
    fit = fit_batches(profiles)
    graph_plan_at, graph_plans_note = _graph_plan_at(request, fit, base, graph_profiles, overhead)
    smallest = min(fit.sizes)
    if memory.fit:
        room = fit_bytes_for(replaced(request, batch_size=smallest))
        assert room is not None  # None only off CUDA, refused above
        base_input = fit.trace_at(smallest).input_bytes

        def limit_at(batch: int) -> int:
            return room + base_input - fit.trace_at(batch).input_bytes
    else:
        assert memory.bytes is not None

        def limit_at(batch: int) -> int:
            return memory.bytes  # type: ignore[return-value]

    def least_at(batch: int) -> Plan:
        """The least-peak plan at ``batch`` (or the fastest within ``overhead``), graph plans included."""
        trace = fit.trace_at(batch)
        plans = [best_plan(trace, overhead), *([graph_plan_at(batch, trace)] if graph_plan_at else [])]
        return min(plans, key=lambda p: p.predicted_peak_bytes)

    say("searching the batch size", 0.35)
    answer = largest_batch(fit, limit_at, overhead=overhead, graph_plan_at=graph_plan_at)
    batch, plan, trace = answer.batch_size, answer.plan, answer.trace
    stepped_back = 0
    out_of_memory_batch = None
    while True:
        say(f"measuring batch {batch} with {plan.algorithm}", 0.5)
        at_batch = replaced(request, batch_size=batch)
        try:
            if plan.is_graph_plan:  # the op graph is traced at the batch itself (an exported graph is sized)
                built = build(at_batch)
                built.op_graph = pipeline.op_graph(built)
            else:
                built = build(at_batch, probe_batch=smallest)
            measured = pipeline.validate(built, trace, [plan], timing_rounds=1, check_gradients=False)[plan.label]
            over = measured.measured_peak_bytes is not None and measured.measured_peak_bytes > limit_at(batch)
            why = f"measured {measured.measured_peak_bytes} bytes, over the {limit_at(batch)}"
        except OutOfMemoryProfiling:
            # Under ``fit`` the prediction is of allocated bytes; the caching allocator also needs room for
            # its own rounding and fragmentation, which the last few percent of a device may not have.
            measured, over, why = None, True, "ran out of device memory"
            out_of_memory_batch = batch
        built = None
        _release_device_memory(request.device)
        if not over:
            break
        if stepped_back == MAX_STEP_BACKS or batch == 1:
            raise MaxBatchError(f"memory: batch {batch}'s step {why} its prediction "
                                f"({plan.predicted_peak_bytes} bytes) met, {stepped_back} steps back from "
                                f"{answer.batch_size}; the profiles do not predict this model's larger batches")
        stepped_back += 1
        batch = batch - 1 if measured is not None else max(1, int(batch * (1 - OOM_STEP_BACK)))
        trace = fit.trace_at(batch)
        plan = least_at(batch)
    assert measured is not None
    say("done", 1.0)
    return MaxBatchReport(request=replaced(request, batch_size=batch), batch_size=batch, plan=plan,
                          limit_bytes=limit_at(batch), measured=measured,
                          next_plan=answer.next_plan if not stepped_back else least_at(batch + 1),
                          next_limit_bytes=limit_at(batch + 1), profiled_batches=fit.sizes,
                          fit_summary=fit.describe(), stepped_back=stepped_back, overhead=overhead,
                          out_of_memory_batch=out_of_memory_batch, graph_plans_note=graph_plans_note)


def _graph_plan_at(request: ModelRequest, fit: SizeFit, base: BuiltModel | None,
                   graph_profiles: Sequence[GraphProfile | None], overhead: float | None
                   ) -> tuple[GraphPlanAt | None, str | None]:
    """How ``max-batch`` prices graph plans at any batch (``pipeline.graph_plan_at_any_batch``), or None with
    the reason where it cannot. ``base``: the smallest profiled batch's model, with its op graph."""
    from remat.client.derived_trace import SizeFitError
    from remat.client.precision import autocast_dtype
    from remat.worker import pipeline

    if overhead is not None:
        return None, "a graph plan has no recompute estimate to hold to --overhead"
    if request.device != "cpu":
        return None, f"the graph predictor's step profile is taken on the cpu only, not on {request.device}"
    if autocast_dtype(request.dtype):
        return None, f"the graph predictor's step profile is not taken under {request.dtype} autocast"
    stored_graph = fit.profiles[0].graph
    if base is None or stored_graph is None or any(p is None for p in graph_profiles):
        return None, "this model has no op graph whose profile explains its step"
    if stored_graph.num_vertices != base.op_graph.num_vertices:
        return None, (f"the stored profiles' op graph has {stored_graph.num_vertices} vertices, this model's "
                      f"{base.op_graph.num_vertices}")
    try:
        return pipeline.graph_plan_at_any_batch(base, graph_profiles, fit.sizes), None  # type: ignore[arg-type]
    except SizeFitError as exc:  # the profiles differ in more than their byte counts
        return None, str(exc)


def plan_zoo(requests: Iterable[ModelRequest], *, refresh: bool = False,
             on_start: Callable[[ModelRequest], None] | None = None,
             on_row: Callable[[ZooRow], None] | None = None,
             progress: ProgressFn | None = None) -> list[ZooRow]:
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


# --- remat.client.checkpoint: the model a training script holds ---------------------------------------------

def plan_held_model(built: BuiltModel, algorithm: str, progress: ProgressFn | None = None, *,
                    budget: BudgetSpec | None = None) -> tuple[ProfileResult, Plan | None]:
    """Profile a model the caller holds, plan it with every algorithm and its frontier, measure ``none`` and
    ``algorithm``'s plan — or, with ``budget``, the frontier plan it picks — (one training step each,
    gradient-checked) and store it all in the local plan store when there is one.

    Only two plans are measured: this runs inside someone's training job, where every step counts; the
    other plans are stored unmeasured (``remat-client plan`` measures them all).

    Args:
        budget: bytes or a share of this trace's no-checkpoint peak (the caller turns ``fit`` into bytes: it
            knows the device).

    Returns:
        ``(result, chosen)``: the profile and the plan to apply (None for an unknown algorithm). A store that
        refuses the result is a warning, not an error.

    Raises:
        remat.client.budget_spec.BudgetInfeasibleError: no plan fits the budget (raised once the profile is
            stored: it is still worth keeping).
    """
    from remat.client.planning.plans import FRONTIER_MAX_STAGES
    from remat.worker import pipeline

    say = progress or _silent
    trace = _derived_from_store(built)
    if trace is not None:  # a batch size never profiled, of a model profiled at two others: no profile runs
        say(f"deriving from {describe_source(trace)}", 0.1)
        if built.request.mode == "train" and trace.graph is not None:
            built.op_graph = pipeline.op_graph(built)
    else:
        say(f"profiling {built.chain.num_stages} stages", 0.1)
        # NOTE [ graphs on a training job's miss ] A call of several inputs gets its op graph, its graph
        # profile and acg's searched plan only when acg is asked for: they run inside someone's training job,
        # and for a transformer they cost more than the rest of the plan (a two-block GPT-2: search 1.3 s,
        # profile 0.25 s). Otherwise its acg plans the chain, as before transformers had op graphs;
        # `remat-client plan` and the workers always build the graph.
        several = bool(getattr(built.example, "signature", ""))
        trace = pipeline.profile(built, with_graph=not several or algorithm == "acg")
    plans = pipeline.plans_for(built, trace, frontier=trace.num_stages <= FRONTIER_MAX_STAGES or budget is not None)
    if trace.graph is not None and built.op_graph is None:
        plans = tuple(p for p in plans if not p.is_graph_plan)
    infeasible = None
    chosen: Plan | None
    if budget is not None:
        try:
            chosen = pick_from_frontier([p for p in plans if p.budget_bytes], budget)
        except BudgetInfeasibleError as exc:
            chosen, infeasible = None, exc
    else:
        chosen = next((p for p in plans if p.algorithm == algorithm and not p.budget_bytes), None)
    measured = [p for p in plans if p.algorithm == "none"] + ([chosen] if chosen is not None else [])
    measurements = pipeline.validate(built, trace, measured, progress=say, start=0.5, end=0.95, timing_rounds=1)
    result = ProfileResult(request=built.request, key=built.key, trace=trace, plans=plans, measurements=measurements)
    _keep_locally(result)
    if infeasible is not None:
        raise infeasible
    return result, chosen


def _derived_from_store(built: BuiltModel) -> Trace | None:
    """The trace at the built model's batch size derived from profiles the local store holds at two or more
    other batch sizes; None without a store, or without such profiles."""
    try:
        from remat.service.store import PlanStore
    except ImportError:
        return None  # a machine with torch alone (a GPU image) has no store
    with PlanStore() as store:
        return derive_trace(store.size_profiles(built.key), built.key)


def _keep_locally(result: ProfileResult) -> None:
    """Store a profile in the local plan store when there is one; a store that refuses it is a warning."""
    try:
        from remat.service.store import PlanStore
    except ImportError:
        return  # a machine with torch alone (a GPU image) has no store
    try:
        with PlanStore() as store:
            store.save_profile(result.trace, result.plans, result.measurements)
    except Exception as exc:  # noqa: BLE001 - the plan is good; only keeping a copy here failed
        warnings.warn(f"remat: the local plan store did not take the plan ({type(exc).__name__}: {exc}); "
                      f"it is kept in the plan cache only", RuntimeWarning, stacklevel=4)


