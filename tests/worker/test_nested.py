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
