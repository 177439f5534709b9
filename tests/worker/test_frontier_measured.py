"""The Pareto frontier judged by real steps: tighter budgets never measure a higher peak.

Points of two models' frontiers are measured with a training step on CPU (the exact live-storage meter):
measured peaks must fall with the budget as the predictions do, each within 0.5% of its prediction. Every
point of a frontier of up to ``MEASURED_POINTS``; of a longer one (MobileNetV2's), that many spread evenly over
it, both ends included, since each point's step costs seconds and the order is a property of any subsequence.
"""

from __future__ import annotations

import pytest

from remat.client.graph import built_model
from remat.client.planning.plans import frontier_plans
from remat.client.request import ModelRequest
from remat.worker import pipeline

MEASURED_POINTS = 10


@pytest.mark.parametrize("model", ["resnet18", "mobilenet_v2"])
def test_every_frontier_point_measures_within_its_budget_in_order(model: str) -> None:
    request = ModelRequest(spec=model, batch_size=2, sample_shape=(3, 32, 32), grads="kept")
    built = built_model.build(request)
    trace = pipeline.profile(built)
    whole = frontier_plans(trace)
    assert len(whole) >= 4, "a frontier this short would not test the order"
    frontier = [whole[round(i * (len(whole) - 1) / (MEASURED_POINTS - 1))] for i in range(MEASURED_POINTS)] \
        if len(whole) > MEASURED_POINTS else whole
    measured = pipeline.validate(built, trace, frontier, timing_rounds=1, check_gradients=False)
    peaks = [measured[p.label].measured_peak_bytes for p in frontier]
    for plan, peak in zip(frontier, peaks, strict=True):
        assert peak == pytest.approx(plan.predicted_peak_bytes, rel=0.005), plan.label
        assert peak <= plan.budget_bytes * 1.005  # within the budget the point answers
    assert peaks == sorted(peaks), "a tighter budget measured a higher peak"
    costs = [p.recompute_ms for p in frontier]
    assert costs == sorted(costs, reverse=True)


def test_plans_that_are_one_step_are_measured_once_and_share_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ one step, one measurement ]: two planners' plans at the same checkpoints are one training step,
    so one metered step, gradient check and timing stand for both; measured twice, timing noise told users
    the same step had two costs."""
    from dataclasses import replace

    from remat.client.planning.plans import STORED_COST_MODEL, make_plan
    from remat.worker import measure

    request = ModelRequest(spec="resnet18", batch_size=2, sample_shape=(3, 32, 32), grads="kept")
    built = built_model.build(request)
    trace = pipeline.profile(built)
    none, linear = (make_plan(trace, name, cost_model=STORED_COST_MODEL) for name in ("none", "linear"))
    assert linear.checkpoints, "the test needs a plan that recomputes something"
    twin = replace(linear, algorithm="cubic")  # another planner's plan on the same boundaries
    metered: list[tuple[int, ...]] = []
    real = measure.measure_step

    def counted(model, example, checkpoints, **kwargs):  # noqa: ANN001, ANN202
        metered.append(tuple(checkpoints))
        return real(model, example, checkpoints, **kwargs)

    monkeypatch.setattr(measure, "measure_step", counted)
    out = pipeline.validate(built, trace, [none, linear, twin], timing_rounds=2)
    assert metered == [(), linear.checkpoints]
    assert out["cubic"] == replace(out["linear"], algorithm="cubic")
    assert out["linear"].grad_check_passed and out["linear"].baseline_step_ms == out["none"].step_ms
    assert out["linear"].measured_peak_bytes < out["none"].measured_peak_bytes
