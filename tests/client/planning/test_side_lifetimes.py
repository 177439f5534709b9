"""Side values whose lifetime in backward depends on the plan (cost_models.SideLifetimes).

Hand-worked traces pin each rule of NOTE [side value lifetimes] by an exact number; a property test checks that
the tables the planners minimise never price a plan below its exact peak. The rules themselves were measured on
a real encoder–decoder (tests/worker/test_several_inputs.py: T5, every plan against the live-storage meter).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remat.client.planning.cost_models import PytorchTables, peak_candidates, pytorch_peak, tables_peak
from remat.client.trace import TRACE_FORMAT, Trace, parse_trace


def _trace(backward: list[int], sides: list[dict], *, outputs: list[int] | None = None,
           saved: list[int] | None = None) -> Trace:
    n = len(backward)
    outputs = outputs or [0] * n
    saved = saved or [0] * n
    by_stage, unsaved = [0] * n, [0] * n
    for v in sides:
        by_stage[v["stage"] - 1] += v["bytes"]
        if not v.get("saved_by"):
            unsaved[v["stage"] - 1] += v["bytes"]
    return parse_trace({
        "format": TRACE_FORMAT, "input_bytes": 0,
        "stages": [{"name": f"s{i}", "output_bytes": d, "saved_bytes": e, "backward_peak_bytes": b}
                   for i, (d, e, b) in enumerate(zip(outputs, saved, backward, strict=True), 1)],
        "side_bytes": sum(by_stage), "side_by_stage": by_stage,
        "side_unsaved_bytes": sum(unsaved), "side_unsaved_by_stage": unsaved,
        "side_values": sides})


# Four stages whose backward peaks (2000 at stage 3, 1000 at 4) decide every plan, and one side value of 100 bytes
# made by stage 1: the peak is 2000 or 1000 plus what of it the plan keeps alive there.
_BACKWARD = [0, 0, 2000, 1000]


@pytest.mark.parametrize(("saved_by", "plan", "expected", "why"), [
    ([], (), 2000, "no checkpoint: nothing saves it, no frame holds it"),
    ([], (1,), 2000, "the only frame starts before it is made (the tables' bound says 2100)"),
    ([], (1, 2), 2100, "the frame of (1, 2] was handed it and holds it through the last segment's backward"),
    ([], (3,), 2000, "its re-run copy dies with the re-run: nothing in (0, 3] saves it"),
    ([], (1, 3), 2100, "(1, 3] was handed it: its own frame holds it through its backward"),
    ([2], (), 2100, "stage 2 saves it until its backward, after stage 3's"),
    ([2], (3,), 2100, "the re-run's copy, saved by stage 2, waits for stage 2's backward"),
    ([2], (2,), 2000, "its saver is checkpointed and the frame of (0, 2] made it: gone in (2, 4]"),
])
def test_a_side_values_lifetime_follows_the_plan(saved_by: list[int], plan: tuple[int, ...], expected: int,
                                                 why: str) -> None:
    trace = _trace(_BACKWARD, [{"stage": 1, "bytes": 100, "saved_by": saved_by}])
    assert pytorch_peak(trace, plan) == expected, why
    assert peak_candidates(trace, plan)[0][0] == expected


def test_a_side_values_gradient_lives_from_its_first_sender_to_its_maker_whatever_the_plan() -> None:
    # Stage 4's backward sends a 50-byte gradient to the value stage 1 made: alive in stages 1..3's backward and
    # in any re-run that stage 3's backward starts, not in stage 4's (its own measured peak holds it there).
    trace = _trace(_BACKWARD, [{"stage": 1, "bytes": 100, "grad_bytes": 50, "grad_from": [4]}])
    assert pytorch_peak(trace, ()) == 2050
    assert pytorch_peak(trace, (3,)) == 2050
    tables = PytorchTables(trace)
    assert tables.delta[3] == 50 and tables.delta[4] == 0
    assert tables.back[4] == 1000


@st.composite
def _traces_with_side_values(draw: st.DrawFn) -> tuple[Trace, tuple[int, ...]]:
    n = draw(st.integers(2, 9))
    sizes = st.integers(0, 1000)
    sides = []
    for _ in range(draw(st.integers(1, 4))):
        stage = draw(st.integers(1, n))
        later = list(range(stage, n + 1))
        saved_by = sorted(draw(st.sets(st.sampled_from(later), max_size=3)))
        senders = sorted(draw(st.sets(st.sampled_from(later[1:]), max_size=2))) if stage < n else []
        sides.append({"stage": stage, "bytes": draw(sizes), "saved_by": saved_by,
                      "grad_bytes": draw(sizes) if senders else 0, "grad_from": senders})
    trace = _trace(draw(st.lists(sizes, min_size=n, max_size=n)), sides,
                   outputs=draw(st.lists(sizes, min_size=n, max_size=n)),
                   saved=draw(st.lists(sizes, min_size=n, max_size=n)))
    plan = tuple(sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1))))
    return trace, plan


@settings(max_examples=300, deadline=None)
@given(_traces_with_side_values())
def test_the_planners_tables_never_price_a_plan_below_its_exact_peak(case: tuple[Trace, tuple[int, ...]]) -> None:
    trace, plan = case
    assert pytorch_peak(trace, plan) <= tables_peak(trace, plan)
    # Saved by every stage from its maker on, a side value is alive wherever the tables say: they are exact.
    n = trace.num_stages
    everywhere = [{**v.to_dict(), "saved_by": list(range(v.stage, n + 1))} for v in trace.side_values]
    resident = parse_trace({**trace.to_dict(), "side_values": everywhere, "side_unsaved_bytes": 0,
                            "side_unsaved_by_stage": [0] * n})
    assert pytorch_peak(resident, plan) == tables_peak(resident, plan)
