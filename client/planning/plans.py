"""Turn a trace into reported plans: run a planner, evaluate it, estimate its recompute time.

This is the one place that knows how a planner's checkpoints become a :class:`~remat.client.plan.Plan`, so
the CLI, the service and the worker all report the same figures for the same trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from remat.client.budget_spec import pick_for_budget
from remat.client.plan import BUDGET_ALGORITHM, COST_MODELS, NESTED_KEY, PLANNED_BY_KEY, Plan
from remat.client.planning.cost_models import peak
from remat.client.planning.planners import PLANNERS, get_planner
from remat.client.planning.recompute_time import recompute_ms
from remat.client.trace import Trace

STORED_COST_MODEL = "pytorch"
"""The model every stored plan is reported under, whatever its planner optimises: its prediction is then
comparable with the peak a validation step measures (the classic model counts no saved tensors)."""


def step_ms(trace: Trace) -> float | None:
    """Time of one step without checkpointing: the profiler's measured step (``timing.step_ms``), else the sum
    of the stages' forward and backward times when the trace has both."""
    timing = trace.metadata.get("timing")
    measured = timing.get("step_ms") if isinstance(timing, dict) else None
    if isinstance(measured, int | float) and not isinstance(measured, bool) and measured > 0:
        return float(measured)
    if not trace.has_times or any(s.backward_ms is None for s in trace.stages):
        return None
    return sum((s.forward_ms or 0.0) + (s.backward_ms or 0.0) for s in trace.stages)


def make_plan(trace: Trace, algorithm: str, *, cost_model: str | None = None) -> Plan:
    """Run one planner and report its plan under ``cost_model`` (default: the planner's own).

    A planner that ``plans_graphs`` returns a graph plan when the trace has an op graph; such a plan is
    reported under the ``classic`` model whatever is asked, the only one defined on graphs so far. A nested
    planner's plan is reported under ``pytorch`` (:func:`_nested_reported`).
    """
    spec = get_planner(algorithm)
    model = cost_model or spec.native_cost_model
    if model not in COST_MODELS:
        raise ValueError(f"cost model {model!r} is unknown; choose one of {', '.join(COST_MODELS)}")
    if spec.plans_graphs and trace.graph is not None:
        return graph_plan(trace, algorithm)
    if spec.nested:
        return _nested_reported(trace, algorithm)
    return _reported(trace, algorithm, spec.fn(trace, cost_model=model), model)


def _nested_reported(trace: Trace, algorithm: str) -> Plan:
    """A nested planner's plan (``Plan.nested``), reported under the ``pytorch`` model whatever is asked (the
    only one with a nested price, remat.client.planning.nested), against no checkpointing; where nesting
    lowers nothing, ``linear``'s one-level plan under the planner's name (``nested_or_one_level``)."""
    from remat.client.planning.nested import nested_or_one_level, nested_recompute_ms

    checkpoints, nested, predicted = nested_or_one_level(trace)
    if not nested:  # nesting lowers nothing here: linear's plan, one level (nested_or_one_level)
        return _reported(trace, algorithm, checkpoints, STORED_COST_MODEL)
    return Plan(algorithm=algorithm, cost_model=STORED_COST_MODEL, checkpoints=tuple(checkpoints),
                predicted_peak_bytes=predicted,
                baseline_peak_bytes=peak(trace, (), STORED_COST_MODEL), num_stages=trace.num_stages,
                recompute_ms=nested_recompute_ms(trace, checkpoints), step_ms=step_ms(trace),
                extra={NESTED_KEY: True})


def graph_plan(trace: Trace, algorithm: str) -> Plan:
    """``algorithm``'s plan on the trace's op graph (its registered ``graph_fn``), reported under the planner's
    graph model, against keeping every vertex."""
    graph_fn = get_planner(algorithm).graph_fn
    if graph_fn is None or trace.graph is None:
        raise ValueError(f"{algorithm} plans no op graph, or the trace has none")
    found = graph_fn(trace)
    return Plan(
        algorithm=algorithm, cost_model=found.cost_model, checkpoints=(), dropped_vertices=found.dropped_vertices,
        num_vertices=trace.graph.num_vertices, predicted_peak_bytes=found.predicted_peak_bytes,
        baseline_peak_bytes=found.baseline_peak_bytes, num_stages=trace.num_stages, recompute_ms=None,
        step_ms=step_ms(trace),
    )


def _reported(trace: Trace, algorithm: str, checkpoints: Sequence[int], cost_model: str,
              budget_bytes: int | None = None) -> Plan:
    """A planner's checkpoints as a Plan with the figures every plan reports, under ``cost_model``."""
    return Plan(
        algorithm=algorithm,
        cost_model=cost_model,
        checkpoints=tuple(checkpoints),
        predicted_peak_bytes=peak(trace, checkpoints, cost_model),
        baseline_peak_bytes=peak(trace, (), cost_model),
        num_stages=trace.num_stages,
        recompute_ms=recompute_ms(trace, checkpoints),
        step_ms=step_ms(trace),
        budget_bytes=budget_bytes,
    )


def plan_all(trace: Trace, *, cost_model: str | None = None,
             algorithms: Sequence[str] | None = None) -> list[Plan]:
    """Plans from every registered algorithm (or those named), in registry order."""
    return [make_plan(trace, name, cost_model=cost_model) for name in (algorithms or list(PLANNERS))]




def make_budget_plan(trace: Trace, budget_bytes: int) -> Plan:
    """The least-recompute plan whose ``pytorch`` peak fits ``budget_bytes``: the frontier plan it picks,
    stored (like every frontier plan) under its own peak, the tightest budget it answers. The nested planners'
    plans join the frontier where they peak below every chain plan (NOTE [ budgets below the chains ]); a
    trace's graph plans are priced under ``classic`` without the model's graph profile, so none joins here.

    Raises:
        remat.client.budget_spec.BudgetInfeasibleError: no plan fits; it names the smallest peak and whose.
    """
    nested = [make_plan(trace, name) for name, spec in PLANNERS.items() if spec.nested]
    points = sorted((p for p in with_points_below_chains([*nested, *frontier_plans(trace)]) if p.budget_bytes),
                    key=lambda p: p.predicted_peak_bytes)
    return pick_for_budget(points, budget_bytes, peak=lambda p: p.predicted_peak_bytes, plan=lambda p: p)


def frontier_plans(trace: Trace) -> list[Plan]:
    """The Pareto frontier as plans, tightest peak first; each plan's ``budget_bytes`` is its own peak (the
    smallest budget it answers)."""
    from remat.client.planning.planners import budget

    return [_reported(trace, BUDGET_ALGORITHM, p.checkpoints, STORED_COST_MODEL, p.peak_bytes)
            for p in budget.pareto_frontier(trace)]


# NOTE [ budgets below the chains ] The Pareto frontier (planners/budget.py) is exact over chain plans, and a
# budget used to pick from it alone. But a nested plan, or a graph plan that cuts inside stages, can peak far
# below every chain plan: timm's CrossViT at batch 2 keeps 81.6 MiB under any chain plan (its stages are two
# towers that a chain cannot split), acg's graph plan measured 14.8 MiB, and `--budget 40MiB` was refused as
# "below the smallest feasible peak". Such a plan joins the frontier as a budget point of its own when its peak
# is below the chains' least, where no chain plan answers anyway: the chain points, exact among themselves,
# stay as they are. Its peak must be the measured quantity's prediction (the ``pytorch`` model: a graph plan
# searched under the graph predictor; a ``classic`` graph plan on CUDA does not join). A graph plan has no
# recompute estimate, so it counts as the slowest: among such points one joins only if no point at or below
# its peak is known to be faster.
def with_points_below_chains(plans: Sequence[Plan]) -> list[Plan]:
    """``plans`` with budget points for the nested and graph plans among them that peak below every chain
    plan of the frontier (NOTE [ budgets below the chains ]); those points computed earlier are replaced, so
    calling it again after a graph plan changed is safe. Without chain frontier points, ``plans`` as they are."""
    chains = [p for p in plans if p.budget_bytes and p.runs_as[0] == "chain"]
    if not chains:
        return list(plans)
    least = min(p.predicted_peak_bytes for p in chains)
    candidates = sorted((p for p in plans if not p.budget_bytes and p.runs_as[0] != "chain"
                         and p.cost_model == STORED_COST_MODEL and p.predicted_peak_bytes < least),
                        key=lambda p: (p.predicted_peak_bytes, _cost(p)))
    below: list[Plan] = []
    for plan in candidates:  # tightest first: a point joins if it is faster than every tighter one (so one per step)
        if all(_cost(plan) < _cost(b) for b in below):
            below.append(replace(plan, algorithm=BUDGET_ALGORITHM, budget_bytes=plan.predicted_peak_bytes,
                                 extra={**plan.extra, PLANNED_BY_KEY: plan.algorithm}))
    return [p for p in plans if not p.budget_bytes or p.runs_as[0] == "chain"] + below


def _cost(plan: Plan) -> float:
    """A plan's recompute estimate for ranking budget points; infinite without one (a graph plan's)."""
    return plan.recompute_ms if plan.recompute_ms is not None else float("inf")


FRONTIER_INLINE_STAGES = 500
"""Up to this many stages the frontier is computed with the other plans (O(n²) numpy steps of O(n) work; its
time at 500 stages is in docs/benchmarks.md, "Planner scaling"); a service upload defers larger traces to a
plan job."""
FRONTIER_MAX_STAGES = 2000
"""Above this the frontier is not computed at all: O(n²) vector steps of O(n) work, memory-bound past 1,000 stages
(its time at 2,000 stages is in docs/benchmarks.md, "Planner scaling")."""
VALIDATED_SHARES = (0.7, 0.5)
"""Budgets, as shares of the no-checkpoint peak, whose frontier plans a profiling run measures: the stored
curve is measured at the points users ask for most, not only estimated. Two, because each costs every
`plan MODEL` run a plan's worth of real training steps (a measured step, a gradient check, timing rounds)."""


def plans_to_store(trace: Trace, *, algorithms: Sequence[str] | None = None,
                   frontier: bool | None = None) -> list[Plan]:
    """Every registered planner's plan (or those named) and, unless too large or told not to, the frontier."""
    plans = plan_all(trace, cost_model=STORED_COST_MODEL, algorithms=algorithms)
    if frontier if frontier is not None else trace.num_stages <= FRONTIER_INLINE_STAGES:
        plans = with_points_below_chains(plans + frontier_plans(trace))
    return plans


def frontier_to_validate(plans: Sequence[Plan]) -> list[Plan]:
    """The frontier plans a profiling run measures: those answering :data:`VALIDATED_SHARES` of the
    no-checkpoint peak, then the point halfway along the frontier — at most ``len(VALIDATED_SHARES)``, each
    once, leaving out plans that are a registered planner's step (``Plan.runs_as``; measured anyway: the ends
    of the frontier are usually ``none`` and ``linear``, and a point below the chains is a nested or graph
    plan's)."""
    frontier = sorted((p for p in plans if p.algorithm == BUDGET_ALGORITHM and p.budget_bytes),
                      key=lambda p: p.predicted_peak_bytes)
    if not frontier:
        return []
    base = frontier[-1].baseline_peak_bytes
    measured_elsewhere = {p.runs_as for p in plans if not p.budget_bytes}
    candidates = []
    for share in VALIDATED_SHARES:
        fitting = [p for p in frontier if p.predicted_peak_bytes <= share * base]
        if fitting:
            candidates.append(fitting[-1])
    candidates.append(frontier[len(frontier) // 2])
    chosen: list[Plan] = []
    for plan in candidates:
        if plan not in chosen and plan.runs_as not in measured_elsewhere and len(chosen) < len(VALIDATED_SHARES):
            chosen.append(plan)
    return chosen
