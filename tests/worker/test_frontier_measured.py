"""The Pareto frontier judged by real steps: tighter budgets never measure a higher peak.

Every point of two models' frontiers is measured with a training step on CPU (the exact live-storage
meter): measured peaks must fall with the budget as the predictions do, each within 0.5% of its prediction.
"""

from __future__ import annotations

import pytest

from remat.client.graph import built_model
from remat.client.planning.plans import frontier_plans
from remat.client.request import ModelRequest
from remat.worker import pipeline


@pytest.mark.parametrize("model", ["resnet18", "mobilenet_v2"])
def test_every_frontier_point_measures_within_its_budget_in_order(model: str) -> None:
    request = ModelRequest(spec=model, batch_size=2, sample_shape=(3, 32, 32), grads="kept")
    built = built_model.build(request)
    trace = pipeline.profile(built)
    frontier = frontier_plans(trace)
    assert len(frontier) >= 4, "a frontier this short would not test the order"
    measured = pipeline.validate(built, trace, frontier, timing_rounds=1, check_gradients=False)
    peaks = [measured[p.label].measured_peak_bytes for p in frontier]
    for plan, peak in zip(frontier, peaks, strict=True):
        assert peak == pytest.approx(plan.predicted_peak_bytes, rel=0.005), plan.label
        assert peak <= plan.budget_bytes * 1.005  # within the budget the point answers
    assert peaks == sorted(peaks), "a tighter budget measured a higher peak"
    costs = [p.recompute_ms for p in frontier]
    assert costs == sorted(costs, reverse=True)
