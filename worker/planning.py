"""Turn a trace into reported plans: run a planner, evaluate it, estimate its recompute time.

This is the one place that knows how a planner's checkpoints become a :class:`~remat.client.plan.Plan`, so
the CLI, the service and the worker all report the same figures for the same trace.
"""

from __future__ import annotations

from collections.abc import Sequence

from remat.client.plan import COST_MODELS, Plan
from remat.client.trace import Trace
from remat.worker.cost_models import peak
from remat.worker.planners import PLANNERS, get_planner
from remat.worker.recompute_time import recompute_ms

STORED_COST_MODEL = "pytorch"
"""The model every stored plan is reported under, whatever its planner optimises: its prediction is then
comparable with the peak a validation step measures (the classic model counts no saved tensors)."""


def step_ms(trace: Trace) -> float | None:
    """Forward plus backward time of one step without checkpointing, when the trace has both times."""
    if not trace.has_times or any(s.backward_ms is None for s in trace.stages):
        return None
    return sum((s.forward_ms or 0.0) + (s.backward_ms or 0.0) for s in trace.stages)


def make_plan(trace: Trace, algorithm: str, *, cost_model: str | None = None) -> Plan:
    """Run one planner and report its plan under ``cost_model`` (default: the planner's own)."""
    spec = get_planner(algorithm)
    model = cost_model or spec.native_cost_model
    if model not in COST_MODELS:
        raise ValueError(f"cost model {model!r} is unknown; choose one of {', '.join(COST_MODELS)}")
    checkpoints = spec.fn(trace, cost_model=model)
    return Plan(
        algorithm=algorithm,
        cost_model=model,
        checkpoints=tuple(checkpoints),
        predicted_peak_bytes=peak(trace, checkpoints, model),
        baseline_peak_bytes=peak(trace, (), model),
        num_stages=trace.num_stages,
        recompute_ms=recompute_ms(trace, checkpoints),
        step_ms=step_ms(trace),
    )


def plan_all(trace: Trace, *, cost_model: str | None = None,
             algorithms: Sequence[str] | None = None) -> list[Plan]:
    """Plans from every registered algorithm (or those named), in registry order."""
    return [make_plan(trace, name, cost_model=cost_model) for name in (algorithms or list(PLANNERS))]


BUDGET_ALGORITHM = "budget"
"""The algorithm name of plans chosen for a byte budget (``remat.worker.planners.budget``). Not in the
registry of planners that need only a trace: a budget plan is one per (trace, budget), stored under its
budget in the plan key."""


def _budget_plan(trace: Trace, checkpoints: Sequence[int], budget_bytes: int | None) -> Plan:
    return Plan(
        algorithm=BUDGET_ALGORITHM,
        cost_model=STORED_COST_MODEL,
        checkpoints=tuple(checkpoints),
        predicted_peak_bytes=peak(trace, checkpoints, STORED_COST_MODEL),
        baseline_peak_bytes=peak(trace, (), STORED_COST_MODEL),
        num_stages=trace.num_stages,
        recompute_ms=recompute_ms(trace, checkpoints),
        step_ms=step_ms(trace),
        budget_bytes=budget_bytes,
    )


def make_budget_plan(trace: Trace, budget_bytes: int) -> Plan:
    """The least-recompute plan whose ``pytorch`` peak fits ``budget_bytes``.

    Raises:
        remat.worker.planners.budget.BudgetInfeasibleError: no plan fits; it names the smallest peak.
    """
    from remat.worker.planners import budget

    return _budget_plan(trace, budget.plan(trace, budget_bytes=budget_bytes), budget_bytes)


def frontier_plans(trace: Trace) -> list[Plan]:
    """The Pareto frontier as plans, tightest peak first; each plan's ``budget_bytes`` is its own peak (the
    smallest budget it answers)."""
    from remat.worker.planners import budget

    return [_budget_plan(trace, p.checkpoints, p.peak_bytes) for p in budget.pareto_frontier(trace)]
