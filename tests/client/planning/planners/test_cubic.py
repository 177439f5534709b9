"""cubic attains the classic minimum on every trace exhaustive search can judge (n = 1..14)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from remat.client.planning.cost_models import classic_peak
from remat.client.planning.planners import cubic
from remat.client.planning.plans import make_plan
from remat.client.trace import make_trace
from tests.oracles import exhaustive_min
from tests.strategies import traces


@settings(max_examples=300, deadline=None)
@given(traces(min_n=1, max_n=14, full=False))
def test_cubic_attains_the_exhaustive_classic_minimum(trace) -> None:
    best, _ = exhaustive_min(trace, classic_peak)
    checkpoints = cubic.plan(trace)
    assert classic_peak(trace, checkpoints) == best


@settings(max_examples=100, deadline=None)
@given(traces(min_n=1, max_n=12, full=True))
def test_reported_peak_is_the_models_value(trace) -> None:
    plan = make_plan(trace, "cubic")
    assert plan.cost_model == "classic"
    assert plan.predicted_peak_bytes == classic_peak(trace, plan.checkpoints)
    assert plan.baseline_peak_bytes == classic_peak(trace, ())
    assert list(plan.checkpoints) == sorted(set(plan.checkpoints))


@pytest.mark.parametrize(("sizes", "expected_peak"), [
    ([7], 0),
    ([1, 1], 1),
    ([0, 0, 0, 0], 0),
    ([1] * 9, 4),  # two checkpoints splitting 9 stages into interiors of 2: 2 + 2
    ([1, 1000, 1, 1, 1], 1002),  # the huge stage is paid once, kept or re-run, plus two small ones
])
def test_small_cases_by_hand(sizes: list[int], expected_peak: int) -> None:
    trace = make_trace(sizes)
    assert classic_peak(trace, cubic.plan(trace)) == expected_peak
