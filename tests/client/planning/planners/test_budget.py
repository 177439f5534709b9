"""The ``budget`` planner and the Pareto frontier, judged by exhaustive search.

The oracle scores every plan with the step simulator (tests/step_simulator.py, written from
docs/cost-model.md and not from ``PytorchTables``) and with ``recompute_cost``; the planner's frontier must
be exactly the non-dominated set, and a budget must get the cheapest plan that fits.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remat.client.budget_spec import BudgetInfeasibleError
from remat.client.planning.cost_models import pytorch_peak
from remat.client.planning.planners import budget, linear
from remat.client.planning.planners.budget import pareto_frontier
from remat.client.planning.recompute_time import recompute_cost, recompute_ms
from remat.client.trace import Trace, make_trace
from tests.oracles import exhaustive_frontier
from tests.step_simulator import simulate_peak
from tests.strategies import traces


@st.composite
def timed_traces(draw: st.DrawFn, max_n: int = 11) -> Trace:
    """Traces with every optional field, and forward times with ties (equal, tiny integers) or without."""
    trace = draw(traces(min_n=1, max_n=max_n, full=True))
    n = trace.num_stages
    shape = draw(st.sampled_from(("none", "equal", "tiny", "random")))
    if shape == "none":
        return trace
    if shape == "equal":
        times = [draw(st.sampled_from([0.0, 1.0, 0.37]))] * n
    elif shape == "tiny":
        times = [float(x) for x in draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))]
    else:
        times = draw(st.lists(st.floats(0.0, 500.0, allow_nan=False), min_size=n, max_size=n))
    stages = tuple(dataclasses.replace(s, forward_ms=t, backward_ms=2 * t) for s, t in zip(trace.stages, times,
                                                                                          strict=True))
    return dataclasses.replace(trace, stages=stages)


@settings(max_examples=250, deadline=None)
@given(trace=timed_traces())
def test_frontier_is_exactly_the_non_dominated_plans(trace: Trace) -> None:
    frontier = pareto_frontier(trace)
    expected = exhaustive_frontier(trace, simulate_peak, recompute_cost)
    assert [(p.peak_bytes, p.recompute_cost) for p in frontier] == expected
    for point in frontier:  # each point's plan really has the figures it is listed with
        assert simulate_peak(trace, point.checkpoints) == point.peak_bytes
        assert recompute_cost(trace, point.checkpoints) == point.recompute_cost


@settings(max_examples=250, deadline=None)
@given(trace=timed_traces(), data=st.data())
def test_a_budget_gets_the_cheapest_plan_that_fits(trace: Trace, data: st.DataObject) -> None:
    front = exhaustive_frontier(trace, simulate_peak, recompute_cost)
    min_peak, max_peak = front[0][0], front[-1][0]
    chosen = data.draw(st.sampled_from([p for p, _ in front]) | st.integers(min_peak, max_peak + 10)
                       | st.integers(0, max_peak + 10), label="budget")
    fitting = [time for peak, time in front if peak <= chosen]
    if not fitting:
        with pytest.raises(BudgetInfeasibleError) as info:
            budget.plan(trace, budget_bytes=chosen)
        assert info.value.min_peak_bytes == min_peak
        assert f"{min_peak} bytes" in str(info.value)
        return
    checkpoints = budget.plan(trace, budget_bytes=chosen)
    assert simulate_peak(trace, checkpoints) <= chosen
    assert recompute_cost(trace, checkpoints) == min(fitting)


@settings(max_examples=100, deadline=None)
@given(trace=timed_traces(max_n=30))
def test_frontier_ends_at_no_checkpointing_and_at_the_linear_peak(trace: Trace) -> None:
    """Its cheapest point costs nothing and its smallest peak is linear's optimum (n up to 30)."""
    frontier = pareto_frontier(trace)
    assert frontier[-1].recompute_cost == 0
    assert frontier[0].peak_bytes == pytorch_peak(trace, linear.plan(trace))
    assert [p.peak_bytes for p in frontier] == sorted({p.peak_bytes for p in frontier})
    costs = [p.recompute_cost for p in frontier]
    assert costs == sorted(costs, reverse=True) and len(set(costs)) == len(costs)


def test_recompute_cost_is_the_forward_time_before_the_last_checkpoint() -> None:
    stages = [{"name": "a", "output_bytes": 100, "saved_bytes": 100, "forward_ms": 5.0},
              {"name": "view", "output_bytes": 100, "saved_bytes": 0, "saves_nothing": True, "forward_ms": 1.0},
              {"name": "b", "output_bytes": 100, "saved_bytes": 100, "forward_ms": 5.0},
              {"name": "c", "output_bytes": 100, "saved_bytes": 100, "forward_ms": 0.25}]
    from remat.client.trace import TRACE_FORMAT, parse_trace

    trace = parse_trace({"format": TRACE_FORMAT, "input_bytes": 0, "stages": stages})
    assert recompute_ms(trace, ()) == 0.0
    assert recompute_ms(trace, (1, 3)) == pytest.approx(11.0)
    assert recompute_ms(trace, (3,)) == pytest.approx(11.0)
    assert recompute_ms(trace, (2,)) == pytest.approx(6.0)  # the view is charged: see recompute_time
    costs = [recompute_cost(trace, budget.plan(trace, budget_bytes=b))
             for b in sorted({p.peak_bytes for p in pareto_frontier(trace)})]
    assert costs == sorted(costs, reverse=True)


def test_without_times_the_cost_is_the_number_of_rerun_stages() -> None:
    trace = make_trace([10, 10, 10, 10])
    frontier = pareto_frontier(trace)
    for point in frontier:
        assert point.recompute_cost == (point.checkpoints[-1] if point.checkpoints else 0)
    assert recompute_ms(trace, frontier[0].checkpoints) is None


def test_an_infeasible_budget_names_the_smallest_feasible_peak() -> None:
    trace = make_trace([1000, 1000, 1000, 1000])
    smallest = pareto_frontier(trace)[0].peak_bytes
    with pytest.raises(BudgetInfeasibleError, match=rf"budget: {smallest - 1} bytes is below the smallest "
                                                    rf"feasible peak, {smallest} bytes"):
        budget.plan(trace, budget_bytes=smallest - 1)


@settings(max_examples=30, deadline=None)
@given(trace=timed_traces(max_n=8), scale=st.sampled_from([2**55, 2**60, 2**70]))
def test_sizes_past_int64_are_exact(trace: Trace, scale: int) -> None:
    """Past 2^59 the frontier runs on Python integers; it must still be the exhaustive one."""
    stages = tuple(dataclasses.replace(s, output_bytes=s.output_bytes * scale + 1, saved_bytes=s.saved_bytes * scale)
                   for s in trace.stages)
    big = dataclasses.replace(trace, stages=stages)
    expected = exhaustive_frontier(big, simulate_peak, recompute_cost)
    assert [(p.peak_bytes, p.recompute_cost) for p in pareto_frontier(big)] == expected


def test_a_one_stage_frameless_segment_is_priced_as_frameless() -> None:
    """Found by mutation testing: a view stage as a segment of its own keeps no checkpoint, and the least
    peak needs it ((2, 3] below); pricing it as an ordinary segment loses that frontier point."""
    from remat.client.trace import TRACE_FORMAT, parse_trace

    stages = [{"name": "s1", "output_bytes": 1, "saved_bytes": 0, "saves_input": True},
              {"name": "s2", "output_bytes": 1, "saved_bytes": 1, "saves_input": True},
              {"name": "view", "output_bytes": 1, "saved_bytes": 0, "saves_nothing": True},
              {"name": "s4", "output_bytes": 1, "saved_bytes": 1, "saves_input": True},
              {"name": "s5", "output_bytes": 1, "saved_bytes": 0, "saves_input": True}]
    trace = parse_trace({"format": TRACE_FORMAT, "input_bytes": 0, "stages": stages})
    frontier = pareto_frontier(trace)
    assert [(p.peak_bytes, p.recompute_cost) for p in frontier] == \
        exhaustive_frontier(trace, simulate_peak, recompute_cost)
    assert frontier[0].checkpoints == (2, 3, 4) and frontier[0].peak_bytes == 3


def test_a_profiling_run_measures_two_frontier_points_besides_the_registered_plans() -> None:
    from remat.client.planning.plans import VALIDATED_SHARES, frontier_to_validate, plans_to_store

    trace = make_trace([100] * 24)
    plans = plans_to_store(trace)
    chosen = frontier_to_validate(plans)
    registered = {p.checkpoints for p in plans if not p.budget_bytes}
    assert 1 <= len(chosen) <= len(VALIDATED_SHARES)
    assert all(p.algorithm == "budget" and p.checkpoints not in registered for p in chosen)
    base = plans[0].baseline_peak_bytes
    frontier = [p for p in plans if p.budget_bytes]
    for share in VALIDATED_SHARES:  # the answer to each share is measured, here or as a registered plan
        answer = max((p for p in frontier if p.predicted_peak_bytes <= share * base),
                     key=lambda p: p.predicted_peak_bytes, default=None)
        assert answer is None or answer in chosen or answer.checkpoints in registered


@pytest.mark.parametrize(("before", "after"), [(0, 0), (1, 2), (3, 1)])
def test_the_recompute_of_a_segments_first_stage_decides_the_least_peak(before: int, after: int) -> None:
    """Stage "heavy"'s full forward peak (1000) is paid only when the checkpointed segment starting at it is
    recomputed, with the next stage's output gradient (10) alive: the least peak is 1010, and a frontier
    that priced that recompute from another stage's table entry would list a smaller one. Empty stages move
    the segment to other starts (found by mutation testing: ``rec_first[i]`` for ``rec_first[i + 1]``)."""
    from remat.client.trace import TRACE_FORMAT, parse_trace

    empty = {"output_bytes": 0, "saved_bytes": 0}
    stages = [empty] * before + [
        {"output_bytes": 10, "saved_bytes": 0, "forward_peak_bytes": 1000, "forward_peak_dropped_bytes": 20,
         "recompute_peak_bytes": 1000},
        {"output_bytes": 10, "saved_bytes": 600},
        {"output_bytes": 10, "saved_bytes": 600},
    ] + [empty] * after
    trace = parse_trace({"format": TRACE_FORMAT, "input_bytes": 0,
                         "stages": [{"name": f"s{i + 1}", **stage} for i, stage in enumerate(stages)]})
    frontier = pareto_frontier(trace)
    assert [(p.peak_bytes, p.recompute_cost) for p in frontier] == \
        exhaustive_frontier(trace, simulate_peak, recompute_cost)
    assert frontier[0].peak_bytes == 1010 == simulate_peak(trace, frontier[0].checkpoints)


def test_the_int64_fast_path_runs_while_the_sentinel_is_below_2_to_the_59(monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented switch: int64 arrays while every value is below 2^59, Python integers from it on;
    ordinary traces, whose peaks are far below, take the fast path."""
    assert budget._entry_dtype((1 << 59) - 1) is np.int64
    assert budget._entry_dtype(1 << 59) is object
    # the int64 path's infinity is above every value it admits, and stays in range with one added
    assert budget._INT64_LIMIT <= budget._INT64_INFINITY and budget._INT64_INFINITY + budget._INT64_LIMIT < 2**63
    seen: list[object] = []
    locals_of = budget._first_segment_locals

    def recording(a: dict[str, np.ndarray], t: object, i: int) -> tuple[np.ndarray, np.ndarray]:
        seen.append(a["d"].dtype)
        return locals_of(a, t, i)

    monkeypatch.setattr(budget, "_first_segment_locals", recording)
    pareto_frontier(make_trace([10**9] * 40))
    assert seen and set(seen) == {np.dtype(np.int64)}


def test_a_300_stage_frontier_ends_at_the_linear_peak() -> None:
    """Past 256 stages an index is no longer a shared small int, so an identity test on the last boundary
    would price a segment starting there (found by mutation testing: ``i is n - 1``)."""
    trace = make_trace([(i * 37) % 101 + 1 for i in range(300)], [(i * 53) % 97 for i in range(300)])
    frontier = pareto_frontier(trace)
    assert frontier[0].peak_bytes == pytorch_peak(trace, linear.plan(trace))
    assert frontier[-1].checkpoints == () and frontier[-1].recompute_cost == 0
    for point in frontier[:: max(1, len(frontier) // 8)]:
        assert simulate_peak(trace, point.checkpoints) == point.peak_bytes
        assert recompute_cost(trace, point.checkpoints) == point.recompute_cost


def test_a_frameless_segment_at_the_last_boundary_but_one_is_priced_once() -> None:
    """Six views, the fifth with a backward peak above its recomputed one: found by mutation testing (a
    recompute slice one entry too long at boundary n - 2 added a second, ordinarily priced copy of the
    frameless segment (4, 5] that kept its zero base and could win, naming boundary n as its parent)."""
    from remat.client.trace import TRACE_FORMAT, parse_trace

    view = {"output_bytes": 1, "saved_bytes": 0, "saves_nothing": True, "backward_peak_bytes": 1}
    stages = [view] * 4 + [{**view, "forward_peak_dropped_bytes": 2, "backward_peak_bytes": 4,
                            "recomputed_backward_peak_bytes": 1}, view]
    trace = parse_trace({"format": TRACE_FORMAT, "input_bytes": 0,
                         "stages": [{"name": f"s{i + 1}", **stage} for i, stage in enumerate(stages)]})
    assert [(p.peak_bytes, p.recompute_cost) for p in pareto_frontier(trace)] == \
        exhaustive_frontier(trace, simulate_peak, recompute_cost)


@pytest.mark.parametrize("saves_nothing", [False, True])
def test_a_one_stage_trace_has_one_point(saves_nothing: bool) -> None:
    trace = make_trace([7], [5])
    if saves_nothing:
        trace = dataclasses.replace(trace, stages=(dataclasses.replace(trace.stages[0], saved_bytes=0,
                                                                       saves_nothing=True),))
    assert pareto_frontier(trace) == [budget.FrontierPoint((), simulate_peak(trace, ()), 0)]


@pytest.mark.parametrize("big", [1000, 2**40])
def test_a_segment_starting_at_boundary_2_counts_only_its_own_stages_recompute(big: int) -> None:
    """Found by mutation testing: the recompute prefix maximum of the first segments (2, j] taken from
    index ``2 ^ 2`` = 0 instead of 4 misprices them here (parameter gradients alive, a view at stage 3, a
    large output at 4) and the frontier differs; 500 random traces did not decide there."""
    from remat.client.trace import TRACE_FORMAT, parse_trace

    layer = {"output_bytes": 0, "saved_bytes": 5, "param_grad_bytes": 1}
    stages = [layer, layer, {"output_bytes": 2, "saved_bytes": 0, "saves_nothing": True, "param_grad_bytes": 1},
              {**layer, "output_bytes": big}, layer, layer, layer]
    trace = parse_trace({"format": TRACE_FORMAT, "input_bytes": 0,
                         "stages": [{"name": f"s{i + 1}", **stage} for i, stage in enumerate(stages)]})
    assert [(p.peak_bytes, p.recompute_cost) for p in pareto_frontier(trace)] == \
        exhaustive_frontier(trace, simulate_peak, recompute_cost)


def test_a_one_stage_segment_at_an_odd_boundary_stops_its_recompute_at_its_own_last_saved_tensor() -> None:
    """Found by mutation testing: a one-stage segment (i, i + 1] priced with stage i - 1's recompute at
    odd i (``i ^ 1``). Every stage here re-runs to a 1024-byte peak, so only the saved bytes below it (U)
    tell the stages apart; the frontier differs when the wrong stage's is taken."""
    from remat.client.trace import TRACE_FORMAT, parse_trace

    stages = [{"output_bytes": 0, "saved_bytes": 0, "saves_nothing": True, "recompute_peak_bytes": 1024}]
    stages += [{"output_bytes": 0, "saved_bytes": 1, "recompute_peak_bytes": 1024}] * 5
    trace = parse_trace({"format": TRACE_FORMAT, "input_bytes": 0,
                         "stages": [{"name": f"s{i + 1}", **stage} for i, stage in enumerate(stages)]})
    assert [(p.peak_bytes, p.recompute_cost) for p in pareto_frontier(trace)] == \
        exhaustive_frontier(trace, simulate_peak, recompute_cost)


@pytest.mark.parametrize(("outputs", "saved"), [([1] * 4, [0] * 4), ([2, 1], [2, 1]), ([1, 1], [1, 1]),
                                                 ([3, 1, 1], [3, 1, 1])])
@pytest.mark.parametrize("exponent", [58, 59, 60, 61])
def test_sizes_near_2_to_the_62_pick_the_integer_path_by_their_largest_value(outputs: list[int], saved: list[int],
                                                                             exponent: int) -> None:
    """Found by mutation testing: a dtype bound that can come out small for huge traces (Σd ^ 2·max, zero
    when Σd = 2·max as in the four equal outputs; Σd & 2·max) sends 2^61-byte traces down the int64 path,
    where they overflow or meet the infinity. The exact frontier needs Python integers there."""
    trace = make_trace([s << exponent for s in outputs], [s << exponent for s in saved])
    assert [(p.peak_bytes, p.recompute_cost) for p in pareto_frontier(trace)] == \
        exhaustive_frontier(trace, simulate_peak, recompute_cost)
