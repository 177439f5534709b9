"""What a plan costs in time (remat.client.planning.recompute_time), priced by hand on small traces."""

from __future__ import annotations

import pytest

from remat.client.errors import TraceFormatError
from remat.client.planning.plans import make_plan, step_ms
from remat.client.planning.recompute_time import recompute_cost, recompute_ms
from remat.client.trace import TRACE_FORMAT, parse_trace


def _trace(recompute: bool = True, **top: object):
    stages = []
    for i, (fwd, rec) in enumerate([(1.0, 1.5), (2.0, 3.5), (4.0, 6.0), (8.0, 9.0)]):
        stage = {"name": f"s{i}", "output_bytes": 4, "saved_bytes": 4, "forward_ms": fwd, "backward_ms": 2 * fwd}
        if recompute:
            stage["recompute_ms"] = rec
        stages.append(stage)
    return parse_trace({"format": TRACE_FORMAT, "input_bytes": 4, "stages": stages, **top})


def test_a_plan_costs_its_stages_re_run_and_a_fixed_time_per_segment() -> None:
    trace = _trace(checkpoint_ms=0.25)
    assert recompute_ms(trace, ()) == 0.0
    assert recompute_ms(trace, (2,)) == pytest.approx(1.5 + 3.5 + 0.25)
    assert recompute_ms(trace, (1, 2, 3)) == pytest.approx(1.5 + 3.5 + 6.0 + 3 * 0.25)
    # The planner's objective is the stage part alone, in integer nanoseconds.
    assert recompute_cost(trace, (1, 2, 3)) == 11_000_000


def test_forward_times_stand_in_where_no_recompute_was_measured() -> None:
    trace = _trace(recompute=False)
    assert trace.checkpoint_ms == 0.0
    assert recompute_ms(trace, (1, 3)) == pytest.approx(1.0 + 2.0 + 4.0)


def test_the_step_estimate_is_the_measured_step_when_the_profiler_timed_one() -> None:
    assert step_ms(_trace()) == pytest.approx(3 * (1 + 2 + 4 + 8))
    timed = _trace(timing={"rounds": 3, "step_ms": 40.0})
    assert step_ms(timed) == 40.0
    plan = make_plan(timed, "linear")
    assert plan.step_ms == 40.0 and plan.recompute_ms == recompute_ms(timed, plan.checkpoints)


@pytest.mark.parametrize("value", [-1.0, True, "1"])
def test_a_bad_checkpoint_time_is_refused_naming_it(value: object) -> None:
    with pytest.raises(TraceFormatError, match="checkpoint_ms"):
        _trace(checkpoint_ms=value)


def test_recompute_ms_round_trips_and_is_refused_when_negative() -> None:
    trace = _trace(checkpoint_ms=0.5)
    assert parse_trace(trace.to_dict()) == trace
    obj = trace.to_dict()
    obj["stages"][1]["recompute_ms"] = -2
    with pytest.raises(TraceFormatError, match=r"stages\[1\]\.recompute_ms"):
        parse_trace(obj)
