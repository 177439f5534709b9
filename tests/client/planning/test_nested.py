"""Nested re-runs priced from the tables: the recurrence against exhaustive search of every plan's price, and
the price against one level where nesting changes nothing. What a nested step really holds is checked against
the live-storage meter in tests/worker/test_nested.py."""

from __future__ import annotations

from itertools import combinations

from hypothesis import given, settings
from hypothesis import strategies as st

from remat.client.planning.cost_models import pytorch_peak
from remat.client.planning.nested import nested_peak, nested_plan
from remat.client.trace import TRACE_FORMAT, Trace, parse_trace

_PEAKS = ("forward_peak_bytes", "forward_peak_dropped_bytes", "recompute_peak_bytes", "backward_peak_bytes",
          "param_grad_bytes")


@st.composite
def _traces(draw: st.DrawFn, max_stages: int = 9) -> Trace:
    n = draw(st.integers(1, max_stages))
    sizes = st.sampled_from([0, 1, 5, 20, 100, 300])
    stages = []
    for i in range(n):
        stage = {"name": f"s{i}", "output_bytes": draw(sizes), "saved_bytes": draw(sizes),
                 "saves_input": draw(st.booleans()), "saves_output": draw(st.booleans())}
        stage |= {name: draw(sizes) for name in _PEAKS if draw(st.booleans())}
        if draw(st.integers(0, 6)) == 0:
            stage |= {"saves_nothing": True, "saved_bytes": 0, "saves_input": False, "saves_output": False}
        stages.append(stage)
    return parse_trace({"format": TRACE_FORMAT, "input_bytes": 0, "stages": stages})


@settings(max_examples=300, deadline=None)
@given(_traces())
def test_the_recurrence_finds_the_least_nested_peak_of_every_plan(trace: Trace) -> None:
    n = trace.num_stages
    every = [c for k in range(n) for c in combinations(range(1, n), k)]
    assert nested_peak(trace, nested_plan(trace)) == min(nested_peak(trace, c) for c in every)


@settings(max_examples=200, deadline=None)
@given(_traces(), st.data())
def test_segments_of_one_stage_are_priced_as_one_level(trace: Trace, data: st.DataObject) -> None:
    n = trace.num_stages
    kept = data.draw(st.sets(st.integers(1, max(n - 1, 1)), max_size=n)) if n > 1 else set()
    # Keep every boundary before the last kept one: each checkpointed segment is then one stage, nothing nests.
    last = max(kept, default=0)
    plan = tuple(range(1, last + 1))
    assert nested_peak(trace, plan) == pytorch_peak(trace, plan)
