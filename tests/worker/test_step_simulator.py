"""The ``pytorch`` cost model against an independent oracle: tests/step_simulator.py replays a step as
allocation events from docs/cost-model.md, sharing no code with client/planning/cost_models.py. Planners are judged by
the simulator too, so a table bug that a planner and the evaluator share cannot hide."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remat.client.planning.cost_models import peak_candidates, pytorch_peak
from remat.client.planning.planners import linear
from remat.client.trace import Trace
from tests.oracles import exhaustive_min
from tests.step_simulator import simulate_peak
from tests.strategies import traces


@st.composite
def _trace_and_plan(draw: st.DrawFn, max_n: int = 9) -> tuple[Trace, tuple[int, ...]]:
    trace = draw(traces(min_n=1, max_n=max_n, full=True))
    n = trace.num_stages
    plan = tuple(sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1)))) if n > 1 else ()
    return trace, plan


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_trace_and_plan())
def test_the_cost_model_equals_the_simulated_step(case: tuple[Trace, tuple[int, ...]]) -> None:
    trace, plan = case
    assert pytorch_peak(trace, plan) == simulate_peak(trace, plan)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(min_n=2, max_n=7, full=True))
def test_the_cost_model_equals_the_simulated_step_for_every_plan_of_a_trace(trace: Trace) -> None:
    """Every segment shape a short trace allows (segments starting at odd and even stages, one-stage and
    longer, frameless or not, before the last one), not one random plan: cosmic-ray mutants that change the
    model only for some of a trace's plans survived the one-plan test."""
    n = trace.num_stages
    for mask in range(1 << (n - 1)):
        plan = tuple(i + 1 for i in range(n - 1) if mask >> i & 1)
        assert pytorch_peak(trace, plan) == simulate_peak(trace, plan), plan


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(min_n=1, max_n=8, full=True))
def test_linear_is_optimal_when_judged_by_the_simulator(trace: Trace) -> None:
    best, _ = exhaustive_min(trace, simulate_peak)
    assert simulate_peak(trace, linear.plan(trace)) == best


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_trace_and_plan())
def test_every_diagnostic_candidate_is_a_moment_of_the_simulated_step(case: tuple[Trace, tuple[int, ...]]) -> None:
    """``peak_candidates`` (what `measure` reports as deciding a peak) lists moments of the step: none exceeds
    the simulated peak and the largest is it."""
    trace, plan = case
    _check_candidates(trace, plan)


def _check_candidates(trace: Trace, plan: tuple[int, ...]) -> None:
    candidates = peak_candidates(trace, plan)
    peak = simulate_peak(trace, plan)
    assert candidates[0][0] == peak, plan
    assert all(value <= peak for value, _ in candidates), plan
    assert candidates == sorted(candidates, key=lambda c: -c[0])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(min_n=2, max_n=7, full=True))
def test_every_diagnostic_candidate_is_a_moment_of_the_simulated_step_for_every_plan(trace: Trace) -> None:
    """As above, over every plan of a short trace (a cosmic-ray survivor took a segment's first stage for a
    middle one, and so counted its input twice, only in segments starting past stage 1)."""
    n = trace.num_stages
    for mask in range(1 << (n - 1)):
        _check_candidates(trace, tuple(i + 1 for i in range(n - 1) if mask >> i & 1))


def test_a_frameless_segment_charges_only_its_own_stages_backward() -> None:
    """A case random traces rarely draw (found by a cosmic-ray survivor: a frameless segment's range reaching
    back before its start went unnoticed): a large checkpoint x_1 that no stage saves, then a frameless
    segment. Stage 1's backward belongs to segment (0, 1], where x_1 is not yet kept: charging it in the
    frameless segment (2, 3], where x_1 is, would count x_1 twice."""
    from remat.client.trace import TRACE_FORMAT, parse_trace

    trace = parse_trace({"format": TRACE_FORMAT, "input_bytes": 0, "stages": [
        {"name": "a", "output_bytes": 100, "saved_bytes": 1, "backward_peak_bytes": 50},
        {"name": "b", "output_bytes": 1, "saved_bytes": 1},
        {"name": "c", "output_bytes": 1, "saved_bytes": 0, "saves_nothing": True},
        {"name": "d", "output_bytes": 1, "saved_bytes": 1}]})
    plan = (1, 2, 3)
    assert pytorch_peak(trace, plan) == simulate_peak(trace, plan) == 103


def _frameless_after_a_large_unsaved_output(backward_peak: int) -> Trace:
    """x_2 is large and no stage saves it; stage 3 saves nothing, so a segment (2, 3] is frameless."""
    from remat.client.trace import TRACE_FORMAT, parse_trace

    return parse_trace({"format": TRACE_FORMAT, "input_bytes": 0, "stages": [
        {"name": "a", "output_bytes": 4, "saved_bytes": 2},
        {"name": "b", "output_bytes": 100, "saved_bytes": 1, "backward_peak_bytes": backward_peak},
        {"name": "c", "output_bytes": 100, "saved_bytes": 0, "saves_nothing": True},
        {"name": "d", "output_bytes": 1, "saved_bytes": 1}]})


def test_a_frameless_forward_adds_to_every_kept_checkpoint() -> None:
    """The peak is stage c's forward in the frameless segment: checkpoints x_1 (4) and x_2 (100) kept, plus its
    output (100). Found by a cosmic-ray survivor that joined the kept bytes with ``|`` (4 | 100 ≠ 104)."""
    trace = _frameless_after_a_large_unsaved_output(backward_peak=0)
    assert pytorch_peak(trace, (1, 2, 3)) == simulate_peak(trace, (1, 2, 3)) == 204
    assert peak_candidates(trace, (1, 2, 3))[0] == (204, "forward of stage 3, frameless segment (2, 3]")


def test_a_frameless_segment_leaves_the_stage_before_it_to_its_own_segment() -> None:
    """Stage b's backward (peak 500) happens in segment (1, 2], beside x_1 only: 504, the peak. The frameless
    segment (2, 3] after it holds no checkpoint frame, so x_2 is not kept there (its forward: 4 + 100 + 100)."""
    trace = _frameless_after_a_large_unsaved_output(backward_peak=500)
    assert pytorch_peak(trace, (1, 2, 3)) == simulate_peak(trace, (1, 2, 3)) == 504
