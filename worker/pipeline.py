"""The profiling pipeline, in one place: a built model → trace → every planner's plan → a measured,
gradient-checked training step per plan.

Building (request or held model → stage chain and plan key) is the client's, in ``remat.client.graph``
(``build``, ``build_from_model``): the caller builds, looks the key up in its store, and runs the rest here
only when the key has no complete answer. Three callers and no other copy of any step: the local mode
(``remat.worker.local``: ``remat-client plan MODEL`` and ``remat.client.checkpoint``'s profile on a miss), the
service client's upload path (``plan MODEL --server``, which profiles here and uploads the trace) and the
Celery task (``remat.worker.tasks.profile_model``). Storing is the caller's: this module knows nothing of
databases.

Public API::

    profile(built) -> Trace
    profile_op_graph(built) -> None                        # the op graph and its graph profile, as profile does
    plans_for(built, trace) -> tuple[Plan, ...]            # every planner; graph plans searched under the predictor
    graph_planned(built, trace, plan) -> Plan              # one graph plan so searched (as it is otherwise)
    graph_plan_at_any_batch(base, graph_profiles, sizes)   # the same at any batch, from graph profiles at a few
    validate(built, trace, plans, progress=None) -> dict[str, Measurement]
    run_built(built, progress=None) -> ProfileResult       # profile, plan with every planner, validate
    run_derived(built, trace, progress=None) -> ProfileResult  # the same from a trace derived at its batch size
    run(request, progress=None) -> ProfileResult           # build, then run_built
    measure_algorithm(request, algorithm, progress=None) -> Measurement
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from remat.client.errors import ModelError
from remat.client.graph.built_model import BuiltModel, build, guard_memory
from remat.client.measurement import Measurement
from remat.client.plan import Plan
from remat.client.planning.max_batch import GraphPlanAt
from remat.client.precision import autocast_dtype
from remat.client.report import ProfileResult
from remat.client.request import ModelRequest, ProgressFn
from remat.client.trace import Trace

__all__ = ["ProfileResult", "graph_plan_at_any_batch", "graph_planned", "measure_algorithm", "plans_for", "profile",
           "profile_op_graph", "run", "run_built", "run_derived", "validate"]

TIMING_ROUNDS = 5
"""Interleaved rounds of timed steps per validation (``measure.time_plans_spread``: fewer past its time budget)."""


def _silent(message: str, fraction: float) -> None:
    return None


def profile(built: BuiltModel, *, timing_repeats: int = 1, with_graph: bool = True) -> Trace:
    """The built model's ``remat-trace/1`` trace, keyed by its architecture hash, with its op graph (train
    mode, when the model has one and ``with_graph``: ``acg`` plans on it)."""
    from remat.worker.profilers import profile as profile_chain

    request = built.request
    try:
        trace = profile_chain(built.model, built.example, device=request.device, grads=request.grads,
                              train=request.mode == "train", chain=built.chain, model_name=request.name,
                              model_hash=built.key.model_hash, precision=request.dtype,
                              timing_repeats=timing_repeats)
        if request.mode == "train" and with_graph:
            profile_op_graph(built)
    except RuntimeError as exc:
        guard_memory(request, exc)
        raise
    if built.op_graph is None:
        return trace
    return replace(trace, graph=built.op_graph.to_trace_graph())


def profile_op_graph(built: BuiltModel) -> None:
    """Set the built model's op graph (None when it has none) and, on the CPU without autocast, where the graph
    predictor is validated, its graph profile: one instrumented step of the unmodified model, kept only when
    its replay explains that step (:func:`explains_its_step`; otherwise neither is kept)."""
    request = built.request
    built.op_graph = op_graph(built)
    if built.op_graph is not None and request.device == "cpu" and not autocast_dtype(request.dtype):
        from remat.worker.graph_profile import profile_graph

        built.graph_profile = profile_graph(built.model, built.example, built.op_graph, grads=request.grads)
        if not explains_its_step(built.graph_profile, built.op_graph):
            built.op_graph = built.graph_profile = None


GRAPH_REPLAY_TOLERANCE = 0.01
"""How far the graph predictor's replay of the unmodified step may be from the peak its profile measured."""


def explains_its_step(profile: Any, graph: Any) -> bool:
    """Whether a graph profile's replay of the unmodified step peaks where the profiled step measured (within
    ``GRAPH_REPLAY_TOLERANCE``): the predictor's check on itself before it judges any plan.

    Why: a replay that misses part of the step judges every plan wrong. One did: CLIP's replay stopped after its first
    7 autograd nodes, of 508 (an output the loss does not read was counted as a gradient to wait for, since
    fixed) and predicted 112.4 against 117.1 MiB unmodified, and 13.3 against 111.9 MiB for the plan its search
    chose. A model whose profile fails this keeps no op graph: ``acg`` plans its chain, as for a trace without
    a graph, and every stored prediction stays one that measures."""
    from remat.client.planning.graph_predict import predict_graph_peak
    from remat.worker.graph_profile import executor_units

    replayed = predict_graph_peak(profile, executor_units(graph, ())).peak
    return abs(replayed - profile.measured_peak_bytes) <= GRAPH_REPLAY_TOLERANCE * profile.measured_peak_bytes


def op_graph(built: BuiltModel) -> Any:
    """The op graph from the chain's own trace (a call's exported graph: NOTE [ an op graph of a call ]), its
    sizes probed in the request's precision; None when the model has none (one source, one sink)."""
    from remat.client.graph.op_graph import build_op_graph
    from remat.client.precision import autocast_context

    try:
        with autocast_context(built.request.dtype, built.example.device.type):
            return build_op_graph(built.model, built.example, graph=built.chain.graph_module)
    except ModelError:
        return None


SEARCH_EVALUATIONS = 2000
"""Plans the graph search predicts for ``acg`` (remat.client.planning.graph_predict.search_plan), each a pure-Python
replay of the step's allocation events; a count, not a clock, so the plan does not depend on the machine's load.
The time per plan and per search is in docs/benchmarks.md ("Graph plans predicted", "Graph plans (`acg`) against
chain plans"): small beside the profile and validation of the same run."""


def graph_planned(built: BuiltModel, trace: Trace, plan: Plan, *, certify_s: float = 0.0) -> Plan:
    """A graph plan under the ``pytorch`` model when the profile has a graph profile: the dropped set of least
    predicted peak among acg's plans, every chain plan of the trace (the chain planners' and the frontier's,
    as dropped sets on the op graph) and a local search from the best (``search_plan``), with the graph
    predictor's peaks, and the step's forced memory as its lower bound (NOTE [forced memory]: no plan of
    this step peaks below it; ``Plan.optimality_gap``). The plan is a function of the trace and the graph
    profile alone, so ``plan`` and ``measure`` agree. Any other plan, or a graph plan without a graph profile
    (CUDA, autocast), as it is.

    With ``certify_s`` > 0 (the slow path), a MILP spends up to that long on the relaxed step (NOTE [relaxed
    step]): its dual bound is stored as the plan's certified bound over one-level graph plans. Its own plan
    is not a seed: the plan stays a function of the trace and the graph profile, whoever certified it."""
    if plan.dropped_vertices is None or built.graph_profile is None:
        return plan
    import functools

    from remat.client.plan import CERTIFIED_BOUND_KEY, CERTIFIED_BY_KEY, LOWER_BOUND_AT_KEY, LOWER_BOUND_KEY
    from remat.client.planning.graph_predict import forced_peak, predict_graph_peak, search_plan
    from remat.client.planning.planners import PLANNERS
    from remat.client.planning.plans import plans_to_store
    from remat.worker.graph_profile import executor_units

    graph, _ = _cut(built, plan)
    chain = built.chain
    chain_planners = [name for name, spec in PLANNERS.items() if not spec.plans_graphs]
    seeds = [(f"chain plan {p.label}", graph.dropped_for_chain_plan(chain.stage_nodes, chain.boundaries, p.checkpoints))
             for p in plans_to_store(trace, algorithms=chain_planners) if p.checkpoints]
    bound = forced_peak(built.graph_profile)
    extra = {**plan.extra, LOWER_BOUND_KEY: bound.peak, LOWER_BOUND_AT_KEY: bound.where}
    if certify_s > 0:
        from remat.client.planning.relaxed_step import Relaxation, certified_bound

        cert = certified_bound(Relaxation.of(built.graph_profile, graph.vertex_nodes, graph.edges), floor=bound.peak,
                               seconds=certify_s)
        how = "solved" if cert.optimal else f"dual bound after {cert.seconds:.0f} s"
        extra |= {CERTIFIED_BOUND_KEY: cert.bound, CERTIFIED_BY_KEY: f"relaxed step, HiGHS MILP, {how}"}
    found = search_plan(built.graph_profile, graph.weights, graph.edges, functools.partial(executor_units, graph),
                        vertex_nodes=graph.vertex_nodes, seeds=seeds, max_evaluations=SEARCH_EVALUATIONS)
    return replace(plan, cost_model="pytorch", dropped_vertices=tuple(found.dropped),
                   predicted_peak_bytes=found.prediction.peak,
                   baseline_peak_bytes=predict_graph_peak(built.graph_profile, executor_units(graph, ())).peak,
                   extra=extra)


def graph_plan_at_any_batch(base: BuiltModel, graph_profiles: Sequence[Any], sizes: Sequence[int]) -> GraphPlanAt:
    """``(batch, trace at that batch) -> its graph plan``, as :func:`graph_planned` searches it, from graph
    profiles at the batch ``sizes`` (remat.client.planning.graph_fit: the profile at any batch) and ``base``'s
    op graph and chain (a model at one of them: the vertices and the chain's seeds are the same at every batch).

    Raises:
        remat.client.derived_trace.SizeFitError: the graph profiles differ in more than their byte counts.
    """
    from remat.client.planning.graph_fit import fit_graph_profiles
    from remat.client.planning.plans import make_plan

    graphs = fit_graph_profiles(graph_profiles, sizes)

    def graph_plan_at(batch: int, trace: Trace) -> Plan:
        return graph_planned(replace(base, graph_profile=graphs.at(batch)), trace, make_plan(trace, "acg"))

    return graph_plan_at


def plans_for(built: BuiltModel, trace: Trace, *, algorithms: Sequence[str] | None = None,
              frontier: bool | None = None, certify_s: float = 0.0) -> tuple[Plan, ...]:
    """Every planner's plan for a profiled model (``planning.plans_to_store``), graph plans searched under the
    predictor where the profile allows (:func:`graph_planned`): what ``run`` and the one-call path store."""
    from remat.client.planning.plans import plans_to_store, with_points_below_chains

    planned = [graph_planned(built, trace, p, certify_s=certify_s)
               for p in plans_to_store(trace, algorithms=algorithms, frontier=frontier)]
    return tuple(with_points_below_chains(planned))  # the graph plan's searched peak may reach below the chains


def _as_graph_measurement(m: Measurement, plan: Plan) -> Measurement:
    """A graph plan's step as measured on the op graph: its vertices (measure_step recorded them as
    checkpoints) and the plan's own prediction, when it has one under the measured model."""
    return replace(m, checkpoints=(), dropped_vertices=plan.dropped_vertices,
                   predicted_peak_bytes=plan.predicted_peak_bytes if plan.cost_model == "pytorch" else None)


def _priced_by_plan(plan: Plan) -> bool:
    """Whether a plan's prediction is its own rather than the ``pytorch`` price of its checkpoints, which
    ``measure_step`` computes from the trace: a graph plan's (the graph predictor) and a nested plan's."""
    return plan.is_graph_plan or plan.nested


def _measured(m: Measurement, plan: Plan) -> Measurement:
    """A measured step with the plan's own prediction where :func:`_priced_by_plan`."""
    if plan.is_graph_plan:
        return _as_graph_measurement(m, plan)
    if plan.nested:
        return replace(m, predicted_peak_bytes=plan.predicted_peak_bytes)
    return m


def _cut(built: BuiltModel, plan: Plan) -> tuple[Any, tuple[int, ...]]:
    """What runs a plan: the op graph and its dropped vertices for a graph plan, the chain run nested and the
    plan's checkpoints for a nested plan, else the chain and the plan's checkpoints."""
    if plan.dropped_vertices is not None:
        if built.op_graph is None or built.op_graph.num_vertices != plan.num_vertices:
            raise ModelError(f"{plan.algorithm}: a graph plan of {plan.num_vertices} vertices, and this model's op "
                             f"graph has {getattr(built.op_graph, 'num_vertices', 'no')} vertices")
        return built.op_graph, plan.dropped_vertices
    if plan.nested:
        from remat.client.graph.stage_chain import NestedRun

        return NestedRun(built.chain), plan.checkpoints
    return built.chain, plan.checkpoints


def validate(built: BuiltModel, trace: Trace, plans: Sequence[Plan], *, progress: ProgressFn | None = None,
             start: float = 0.0, end: float = 1.0, timing_rounds: int = TIMING_ROUNDS,
             check_gradients: bool = True) -> dict[str, Measurement]:
    """A real training step per plan: measured peak beside the prediction, step time, gradient check.

    Step times come from interleaved rounds (every plan once per round): timing the plans one after another put
    a busy minute of the machine on whichever plan ran then (overheads of +3000% seen). With ``none`` among the
    plans, each round runs it between every two plans, and a plan's time is ``none``'s least plus its step read
    against the ``none`` steps beside it (``measure.time_plans_spread``'s ``baseline``).
    Each measurement's baseline fields are those of the ``none`` plan when it is among ``plans``. Keyed by
    :attr:`Plan.label <remat.client.plan.Plan.label>` (the algorithm, and the budget of a frontier plan).
    """
    from remat.worker.measure import gradient_check, measure_step, time_plans_spread

    say = progress or _silent
    request = built.request
    common: dict[str, Any] = {"grads": request.grads, "device": request.device, "chain": built.chain,
                              "train": request.mode == "train", "precision": request.dtype}
    runs = _distinct_runs(built, plans)
    steps = len(runs) + 2
    raw: list[Measurement] = []
    runners, cut_points = [r.runner for r in runs], [r.cut_points for r in runs]
    run_of = {plan.label: k for k, run in enumerate(runs) for plan in run.plans}
    base_k = run_of.get("none")
    try:
        for k, run in enumerate(runs):
            plan = run.plans[0]
            say(f"measuring {', '.join(p.algorithm for p in run.plans)}", start + (end - start) * k / steps)
            # A graph plan's or a nested plan's prediction is its own (None under the classic model).
            raw.append(measure_step(built.model, built.example, run.cut_points,
                                    trace=None if _priced_by_plan(plan) else trace, algorithm=plan.algorithm,
                                    baseline=False, timing_repeats=0, **{**common, "chain": run.runner}))
        checks: list[tuple[bool, float]] | None = None
        if check_gradients:
            say("checking gradients", start + (end - start) * len(runs) / steps)
            checks = gradient_check(built.model, built.example, cut_points, runners=runners, **common)
        say("timing every plan", start + (end - start) * (len(runs) + 1) / steps)
        times = time_plans_spread(built.model, built.example, cut_points, rounds=timing_rounds, runners=runners,
                                  baseline=base_k, **common)
    except RuntimeError as exc:
        guard_memory(request, exc)
        raise
    out: dict[str, Measurement] = {}
    for plan in plans:
        k = run_of[plan.label]
        passed, diff = checks[k] if checks is not None else (None, None)
        out[plan.label] = replace(
            _measured(replace(raw[k], algorithm=plan.algorithm), plan),
            step_ms=times[k][0], step_spread_ms=times[k][1] if timing_rounds > 1 else None,
            grad_check_passed=passed, grad_max_abs_diff=diff,
            baseline_measured_peak_bytes=raw[base_k].measured_peak_bytes if base_k is not None else None,
            baseline_step_ms=times[base_k][0] if base_k is not None else None,
            baseline_step_spread_ms=times[base_k][1] if base_k is not None and timing_rounds > 1 else None)
    return out


@dataclass
class _Run:
    """One distinct training step among the plans validated: what runs it, where it cuts, and every plan that
    is this step (NOTE [ one step, one measurement ])."""

    runner: Any
    cut_points: tuple[int, ...]
    plans: list[Plan]


# NOTE [ one step, one measurement ] Planners often agree: uniform and chen-sqrt cut ResNet-152 at the same seven
# boundaries, and on a small model none, chen-greedy and linear all keep everything. Such plans are one training
# step, so they are measured once and share the measurement (peak, gradient check, step time). Measured as
# separate plans, the same step got step times 10-30% apart from timing noise (ResNet-152, batch 4 at 128²:
# linear 783 ms "+7%" and nested, on the same checkpoints, 764 ms "within noise"; resnet18 at 32²: none 38 ms and
# linear, keeping everything too, 50 ms), a table that tells a user two identical plans differ, and every
# duplicate cost a metered step, a gradient check and a timed step per round. Plans are the same step when the
# same object runs them at the same cut points: the chain's plans at equal checkpoints, graph plans at equal
# dropped vertices. A nested plan runs the chain nested (its own runner), so it is measured on its own even
# where its top-level checkpoints equal another plan's.
def _distinct_runs(built: BuiltModel, plans: Sequence[Plan]) -> list[_Run]:
    """``plans`` grouped by the step that runs them, in first-seen order (NOTE [ one step, one measurement ])."""
    runs: dict[tuple[int, tuple[int, ...]], _Run] = {}
    for plan in plans:
        runner, cut_points = _cut(built, plan)
        run = runs.setdefault((id(runner), tuple(cut_points)), _Run(runner, tuple(cut_points), []))
        run.plans.append(plan)
    return list(runs.values())


def run_built(built: BuiltModel, *, progress: ProgressFn | None = None, timing_rounds: int = TIMING_ROUNDS,
              check_gradients: bool = True, algorithms: Sequence[str] | None = None,
              certify_s: float = 0.0) -> ProfileResult:
    """Profile a built model, plan it with every algorithm (or ``algorithms``) and validate each plan.

    The caller built it (``remat.client.graph.build``) and looked its key up first: a key with a complete
    stored answer never reaches the minutes spent here.
    """
    from remat.client.planning.plans import FRONTIER_MAX_STAGES, frontier_to_validate

    say = progress or _silent
    say(f"profiling {built.chain.num_stages} stages", 0.05)
    trace = profile(built)
    say("planning", 0.4)
    plans = plans_for(built, trace, algorithms=list(algorithms) if algorithms else None,
                      frontier=trace.num_stages <= FRONTIER_MAX_STAGES, certify_s=certify_s)
    measured = [p for p in plans if not p.budget_bytes] + frontier_to_validate(plans)
    measurements = validate(built, trace, measured, progress=say, start=0.42, end=0.98, timing_rounds=timing_rounds,
                            check_gradients=check_gradients)
    measurements.update(_shared_measurements(plans, measurements))
    say("done", 1.0)
    return ProfileResult(request=built.request, key=built.key, trace=trace, plans=plans, measurements=measurements)


def run_derived(built: BuiltModel, trace: Trace, *, progress: ProgressFn | None = None,
                timing_rounds: int = TIMING_ROUNDS, check_gradients: bool = True) -> ProfileResult:
    """:func:`run_built` for a trace derived at the built model's batch size (``remat.client.derived_trace``):
    no profile runs; the model's op graph is cut for graph plans to run on, with its graph profile on the CPU
    (:func:`profile_op_graph`: one instrumented step at this batch), so that ``acg`` is searched under the graph
    predictor as after a profile; then every plan is validated by a measured step as usual, which is what makes a
    derived plan an ordinary one.

    Why the graph profile: without it a derived trace's graph plan was acg's classic optimum, priced by the
    classic model (CrossViT-Tiny at batch 8, 240², from profiles at 2 and 4: predicted 70.1 MiB, measured
    77.5 MiB); one step at the batch costs less than the validation's timed steps of every plan."""
    from remat.client.planning.plans import FRONTIER_MAX_STAGES, frontier_to_validate

    say = progress or _silent
    if built.request.mode == "train" and trace.graph is not None:
        say("the op graph's step", 0.05)
        profile_op_graph(built)
        if built.op_graph is None:  # no graph profile that explains its step: the trace's graph planned as on CUDA
            built.op_graph = op_graph(built)
    say("planning the derived trace", 0.1)
    plans = plans_for(built, trace, frontier=trace.num_stages <= FRONTIER_MAX_STAGES)
    if trace.graph is not None and built.op_graph is None:
        plans = tuple(p for p in plans if not p.is_graph_plan)  # nothing here could run them
    measured = [p for p in plans if not p.budget_bytes] + frontier_to_validate(plans)
    measurements = validate(built, trace, measured, progress=say, start=0.15, end=0.98, timing_rounds=timing_rounds,
                            check_gradients=check_gradients)
    measurements.update(_shared_measurements(plans, measurements))
    say("done", 1.0)
    return ProfileResult(request=built.request, key=built.key, trace=trace, plans=plans, measurements=measurements)


def run(request: ModelRequest, *, progress: ProgressFn | None = None, **options: Any) -> ProfileResult:
    """Build ``request``'s model and :func:`run_built` it (benchmarks and tests; the callers that store look the
    key up between the two)."""
    say = progress or _silent
    say(f"building {request.name}", 0.0)
    return run_built(build(request), progress=say, **options)


def _shared_measurements(plans: Sequence[Plan], measurements: Mapping[str, Measurement]) -> dict[str, Measurement]:
    """Frontier plans that are a measured plan's step (``Plan.runs_as``) get that measurement too."""
    by_step = {p.runs_as: measurements[p.label] for p in plans if p.label in measurements}
    return {p.label: replace(by_step[p.runs_as], algorithm=p.algorithm) for p in plans
            if p.label not in measurements and p.runs_as in by_step}


def measure_algorithm(request: ModelRequest, algorithm: str, *, progress: ProgressFn | None = None) -> Measurement:
    """Profile, plan with one algorithm, and measure the plan beside no checkpointing (``remat-client measure``).

    The plan is predicted under the ``pytorch`` cost model, the one whose prediction speaks of the measured
    quantity.
    """
    from remat.client.planning.plans import STORED_COST_MODEL, make_plan
    from remat.worker.measure import measure_step

    say = progress or _silent
    say(f"building {request.name}", 0.0)
    built = build(request)
    say(f"profiling {built.chain.num_stages} stages", 0.2)
    trace = profile(built)
    plan = graph_planned(built, trace, make_plan(trace, algorithm, cost_model=STORED_COST_MODEL))
    runner, cut_points = _cut(built, plan)
    say(f"measuring {algorithm} and none", 0.5)
    try:
        result = measure_step(built.model, built.example, cut_points, grads=request.grads,
                              device=request.device, chain=runner, train=request.mode == "train",
                              trace=None if _priced_by_plan(plan) else trace, algorithm=algorithm,
                              timing_repeats=TIMING_ROUNDS, precision=request.dtype)
        result = _measured(result, plan)
    except RuntimeError as exc:
        guard_memory(request, exc)
        raise
    say("done", 1.0)
    return result
