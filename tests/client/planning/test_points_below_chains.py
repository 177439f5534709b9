"""Budgets below every chain plan: a nested or graph plan joins the frontier where no chain plan fits (NOTE
[ budgets below the chains ] in remat.client.planning.plans).

The chain's least peak is judged by the step simulator (tests/step_simulator.py, written from docs/cost-model.md)
over every one-level plan, not by the planners' tables; what a nested or graph step really holds is measured in
tests/worker/test_nested.py and tests/worker/test_graph_plans.py.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import combinations

import pytest

from remat.client.budget_spec import BudgetInfeasibleError
from remat.client.plan import BUDGET_ALGORITHM, Plan
from remat.client.planning.plans import (
    frontier_to_validate,
    make_budget_plan,
    plans_to_store,
    with_points_below_chains,
)
from remat.client.trace import make_trace
from tests.step_simulator import simulate_peak

EIGHT = make_trace([100] * 8)
"""Eight equal stages: nesting re-runs reach 500 bytes, and no one-level plan goes below 600."""


def test_a_nested_plan_below_every_chain_plan_answers_the_budgets_no_chain_plan_fits() -> None:
    every = [c for k in range(EIGHT.num_stages) for c in combinations(range(1, EIGHT.num_stages), k)]
    chain_least = min(simulate_peak(EIGHT, c) for c in every)
    plans = plans_to_store(EIGHT)
    nested = next(p for p in plans if p.algorithm == "nested")
    assert nested.nested and nested.predicted_peak_bytes < chain_least  # the case this test needs
    points = sorted((p for p in plans if p.budget_bytes), key=lambda p: p.predicted_peak_bytes)
    assert points[0].runs_as == nested.runs_as and points[0].nested
    assert points[0].budget_bytes == points[0].predicted_peak_bytes == nested.predicted_peak_bytes
    assert points[0].planned_by == "nested" and points[1].planned_by == BUDGET_ALGORITHM  # whose plan it is
    assert points[1].predicted_peak_bytes == chain_least and points[1].runs_as[0] == "chain"

    between = (nested.predicted_peak_bytes + chain_least) // 2
    chosen = make_budget_plan(EIGHT, between)  # plan --trace FILE --budget: the same frontier
    assert chosen.algorithm == BUDGET_ALGORITHM and chosen.nested and chosen.checkpoints == nested.checkpoints
    assert make_budget_plan(EIGHT, chain_least).runs_as == points[1].runs_as  # the chain plan, as before
    with pytest.raises(BudgetInfeasibleError, match=rf"smallest feasible peak, {nested.predicted_peak_bytes} "
                                                    r"bytes \(.* MiB, a nested plan's\)"):
        make_budget_plan(EIGHT, nested.predicted_peak_bytes - 1)
    # The point is nested's own step, measured as nested: a profiling run does not measure it twice.
    assert points[0] not in frontier_to_validate(plans)


def _chain_point(peak: int, recompute_ms: float | None, checkpoints: tuple[int, ...]) -> Plan:
    return Plan(algorithm=BUDGET_ALGORITHM, cost_model="pytorch", checkpoints=checkpoints, predicted_peak_bytes=peak,
                baseline_peak_bytes=1000, num_stages=6, recompute_ms=recompute_ms, budget_bytes=peak)


def _graph(peak: int, dropped: tuple[int, ...], cost_model: str = "pytorch") -> Plan:
    return Plan(algorithm="acg", cost_model=cost_model, checkpoints=(), dropped_vertices=dropped, num_vertices=20,
                predicted_peak_bytes=peak, baseline_peak_bytes=1100, num_stages=6)


def _nested(peak: int, recompute_ms: float) -> Plan:
    return Plan(algorithm="nested", cost_model="pytorch", checkpoints=(3,), predicted_peak_bytes=peak,
                baseline_peak_bytes=1000, num_stages=6, recompute_ms=recompute_ms, extra={"nested": True})


CHAINS = [_chain_point(1000, 0.0, ()), _chain_point(600, 2.0, (3,)), _chain_point(500, 4.0, (2, 4))]


def _below(plans: list[Plan]) -> list[tuple[str, int]]:
    return [(p.runs_as[0], p.predicted_peak_bytes) for p in with_points_below_chains(plans)
            if p.budget_bytes and p.runs_as[0] != "chain"]


@pytest.mark.parametrize(("registered", "expected"), [
    ([_graph(300, (1, 2))], [("graph", 300)]),
    ([_graph(500, (1, 2))], []),  # at the chains' least: a chain plan with an estimate answers it
    ([_graph(700, (1, 2))], []),
    ([_graph(300, (1, 2), cost_model="classic")], []),  # a classic peak predicts no measured memory
    ([_nested(400, 3.0), _graph(300, (1, 2))], [("graph", 300), ("nested", 400)]),
    ([_nested(250, 3.0), _graph(300, (1, 2))], [("nested", 250)]),  # tighter and estimated: the graph plan is
    ([_nested(300, 3.0), _graph(300, (1, 2))], [("nested", 300)]),  # no faster at no lower peak
    ([], []),
])
def test_points_join_below_the_chains_and_only_where_nothing_tighter_is_known_faster(
        registered: list[Plan], expected: list[tuple[str, int]]) -> None:
    assert _below([*registered, *CHAINS]) == expected


def test_the_points_follow_their_plans_when_computed_again() -> None:
    classic = _graph(300, (1, 2), cost_model="classic")
    first = with_points_below_chains([classic, *CHAINS])
    assert [p for p in first if p.budget_bytes and p.is_graph_plan] == []
    searched = replace(classic, cost_model="pytorch", dropped_vertices=(1, 2, 3), predicted_peak_bytes=280)
    again = with_points_below_chains([searched if p is classic else p for p in first])
    point = next(p for p in again if p.budget_bytes and p.is_graph_plan)
    assert point.dropped_vertices == (1, 2, 3) and point.budget_bytes == point.predicted_peak_bytes == 280
    assert with_points_below_chains(again) == again
    assert with_points_below_chains([_graph(300, (1, 2))]) == [_graph(300, (1, 2))]  # no chain frontier asked
