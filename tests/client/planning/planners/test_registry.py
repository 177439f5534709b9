"""Every registered planner, under both cost models: valid checkpoints, reported figures equal the model's."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from remat.client.plan import COST_MODELS
from remat.client.planning.cost_models import peak
from remat.client.planning.planners import PLANNERS, get_planner
from remat.client.planning.plans import make_plan, plan_all
from tests.strategies import traces


@pytest.mark.parametrize("cost_model", COST_MODELS)
@pytest.mark.parametrize("algorithm", list(PLANNERS))
@settings(max_examples=40, deadline=None)
@given(trace=traces(min_n=1, max_n=30, full=True))
def test_reported_plan_is_valid_and_its_figures_are_the_models(algorithm: str, cost_model: str, trace) -> None:
    plan = make_plan(trace, algorithm, cost_model=cost_model)
    n = trace.num_stages
    assert list(plan.checkpoints) == sorted(set(plan.checkpoints))
    assert all(1 <= c <= n - 1 for c in plan.checkpoints)
    if get_planner(algorithm).nested:  # one price only: the pytorch model's, nested or (not lower) one level
        from remat.client.planning.nested import nested_peak

        assert plan.cost_model == "pytorch" and plan.num_stages == n
        assert plan.predicted_peak_bytes == (nested_peak(trace, plan.checkpoints) if plan.nested
                                             else peak(trace, plan.checkpoints, "pytorch"))
        assert plan.baseline_peak_bytes == peak(trace, (), "pytorch")
        return
    assert not plan.nested
    assert plan.algorithm == algorithm and plan.cost_model == cost_model and plan.num_stages == n
    assert plan.predicted_peak_bytes == peak(trace, plan.checkpoints, cost_model)
    assert plan.baseline_peak_bytes == peak(trace, (), cost_model)


@settings(max_examples=60, deadline=None)
@given(trace=traces(min_n=1, max_n=40, full=True))
def test_each_exact_planner_is_best_on_its_own_objective(trace) -> None:
    """On any trace, no other one-level planner beats cubic under classic or linear under pytorch, and nested
    (one level deeper) beats neither under pytorch."""
    for exact, model in (("cubic", "classic"), ("linear", "pytorch")):
        plans = plan_all(trace, cost_model=model)
        best = min(p.predicted_peak_bytes for p in plans if not get_planner(p.algorithm).nested)
        assert next(p for p in plans if p.algorithm == exact).predicted_peak_bytes == best
    plans = plan_all(trace, cost_model="pytorch")
    nested = next(p for p in plans if p.algorithm == "nested")
    linear = next(p for p in plans if p.algorithm == "linear")
    assert nested.predicted_peak_bytes == min(p.predicted_peak_bytes for p in plans)
    # Nested only where it is strictly lower; else linear's very plan, one level.
    assert nested.nested or (nested.checkpoints, nested.predicted_peak_bytes) == (linear.checkpoints,
                                                                                   linear.predicted_peak_bytes)


def test_unknown_planner_lists_the_valid_names() -> None:
    with pytest.raises(ValueError, match="choose one of none, uniform, chen-sqrt, chen-greedy, cubic, linear"):
        get_planner("magic")


def test_recompute_time_counts_every_stage_before_the_last_segment() -> None:
    from remat.client.trace import TRACE_FORMAT, parse_trace

    stages = [{"name": f"s{i}", "output_bytes": 8, "saved_bytes": 8, "forward_ms": float(i + 1),
               "backward_ms": 2.0} for i in range(6)]
    trace = parse_trace({"format": TRACE_FORMAT, "input_bytes": 0, "stages": stages})
    plan = make_plan(trace, "uniform")  # ceil(sqrt(6)) = 3 segments of 2: boundaries (2, 4)
    assert plan.checkpoints == (2, 4)
    assert plan.recompute_ms == pytest.approx(1 + 2 + 3 + 4)
    assert plan.step_ms == pytest.approx(sum(range(1, 7)) + 12.0)
    assert plan.recompute_overhead == pytest.approx(10 / 33)
