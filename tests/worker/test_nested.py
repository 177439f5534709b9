"""Nested re-runs on a real step: ``StageChain.run(..., nested=True)`` against its price
(remat.client.planning.nested) on the live-storage meter, and against the unmodified model's gradients and
BatchNorm statistics."""

from __future__ import annotations

import copy

import torch

from remat.client.graph.built_model import build
from remat.client.graph.stage_chain import NestedRun
from remat.client.planning.nested import nested_peak, nested_plan
from remat.client.planning.plans import make_plan
from remat.client.request import ModelRequest
from remat.worker import pipeline
from remat.worker.measure import gradient_check, measure_step


def test_a_nested_plan_measures_its_price_and_trains_like_the_model() -> None:
    torch.manual_seed(0)
    built = build(ModelRequest(spec="resnet18", batch_size=8, sample_shape=(3, 64, 64), grads="kept"))
    model, x, chain = built.model, built.example, built.chain
    trace = pipeline.profile(built, timing_repeats=0)
    outer, linear = nested_plan(trace), make_plan(trace, "linear", cost_model="pytorch")
    nested = NestedRun(chain)
    measured = measure_step(model, x, outer, grads="kept", chain=nested, baseline=False).measured_peak_bytes
    assert abs(nested_peak(trace, outer) - measured) <= 0.001 * measured
    # At this size nesting goes below the least one-level plan (9.5 against 10.0 MiB).
    one_level = measure_step(model, x, linear.checkpoints, grads="kept", chain=chain, baseline=False)
    assert measured < one_level.measured_peak_bytes
    [(passed, difference)] = gradient_check(model, x, [outer], grads="kept", chain=chain, runners=[nested])
    assert passed and difference == 0.0
    # BatchNorm's running statistics: updated once per step, as without checkpoints, though each stage runs up
    # to three times (the forward, its segment's re-run, its own re-run).
    state = copy.deepcopy(model.state_dict())
    model(x).sum().backward()
    expected = {name: b.clone() for name, b in model.named_buffers()}
    model.load_state_dict(state)
    chain.run(x, outer, nested=True).sum().backward()
    for name, b in model.named_buffers():
        assert torch.equal(b, expected[name]), name


def test_the_registered_nested_planner_is_measured_checked_stored_and_applied(tmp_path) -> None:
    """``nested`` as users get it: the worker's run measures it at its own price with a gradient check, and
    ``apply`` on a fresh copy runs it nested (its step peaks as measured, not as the same checkpoints one
    level would) and trains bit-equal to the unmodified model."""
    from remat.client.apply_plan import apply
    from remat.client.plan import Plan
    from remat.worker.memory_meter import MemoryMeter

    torch.manual_seed(0)
    request = ModelRequest(spec="resnet18", batch_size=8, sample_shape=(3, 64, 64), grads="kept")
    result = pipeline.run(request, algorithms=["none", "linear", "nested"], timing_rounds=1)
    plans = {p.algorithm: p for p in result.plans}
    nested, measured = plans["nested"], result.measurements
    assert nested.nested and not plans["linear"].nested and nested.cost_model == "pytorch"
    assert Plan.from_dict(nested.to_dict()).nested  # the flag survives the wire form (store, API, CLI JSON)
    assert abs(nested.predicted_peak_bytes / measured["nested"].measured_peak_bytes - 1) <= 0.001
    assert measured["nested"].predicted_peak_bytes == nested.predicted_peak_bytes
    assert measured["nested"].grad_check_passed is True
    assert measured["nested"].measured_peak_bytes < measured["linear"].measured_peak_bytes
    assert nested.recompute_ms is not None and nested.recompute_ms > plans["linear"].recompute_ms

    built = build(request)
    reference, x = built.model, built.example
    model = copy.deepcopy(reference)
    apply(model, nested)
    for step in range(2):  # the first builds the applied model's chain; the second is metered
        for m in (reference, model):  # gradients kept: alive at the step's start, as the worker measures
            m.train()
            m.zero_grad(set_to_none=False)
        torch.manual_seed(3)
        reference(x).square().mean().backward()
        with MemoryMeter() as meter:
            meter.mark_baseline()
            torch.manual_seed(3)
            model(x).square().mean().backward()
        for (name, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), (step, name)
        for (name, b), c in zip(reference.named_buffers(), model.buffers(), strict=True):
            assert torch.equal(b, c), (step, name)
    # Run one level, these checkpoints would peak at or above linear's least one-level peak.
    assert meter.peak_above_baseline < measured["linear"].measured_peak_bytes
