"""``acg`` plans on real op graphs: they run, train like the model, and where blocks branch they beat the
best chain plan in measured memory (docs/benchmarks.md, "Graph plans")."""

from __future__ import annotations

import pytest
import torch
import torchvision

from remat.client.budget_spec import BudgetSpec, pick_from_frontier
from remat.client.graph.op_graph import build_op_graph
from remat.client.graph.stage_graph import build_stage_chain
from remat.client.plan import Plan
from remat.client.planning.planners.acg import graph_cost, plan_graph
from remat.client.planning.plans import make_plan
from remat.worker.measure import measure_step
from remat.worker.profilers import profile
from tests.client.graph.test_op_graph import _step
from tests.utils.nas_cell import nas_net

MODELS = {
    "resnet18": (lambda: torchvision.models.resnet18(weights=None), (2, 3, 32, 32)),
    "densenet121": (lambda: torchvision.models.densenet121(weights=None), (2, 3, 32, 32)),
    "googlenet": (lambda: torchvision.models.googlenet(weights=None, aux_logits=True, init_weights=False),
                  (2, 3, 64, 64)),
    "nas_cells": (nas_net, (2, 3, 16, 16)),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_acg_plans_run_and_train_like_the_model(name: str) -> None:
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make().train()
    x = torch.randn(*shape)
    graph = build_op_graph(model, x)
    gp = plan_graph(graph.weights, graph.edges)
    assert graph_cost(graph.weights, graph.edges, gp.kept) == gp.value
    dropped = sorted(v for seg in gp.segments for v in seg.interior)
    assert dropped, "the plan drops nothing"
    state = {k: v.clone() for k, v in model.state_dict().items()}
    reference = _step(model, x, model)[1]
    model.load_state_dict(state)
    planned = _step(model, x, lambda t: graph.run(t, dropped))[1]
    for a, b in zip(planned, reference, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())
    # One checkpointed call per segment, or fewer where a join reads several (they are merged only then).
    assert 0 < len(graph.calls(dropped)) <= len(gp.segments)


def test_on_branching_cells_acg_measures_below_the_best_chain_plan() -> None:
    """The chain cannot cut inside cells that read the two previous cells; the graph plan can."""
    torch.manual_seed(0)
    model = nas_net().train()
    x = torch.randn(2, 3, 16, 16)
    chain = build_stage_chain(model, x)
    trace = profile(model, x, chain=chain, grads="kept", timing_repeats=0)
    linear = make_plan(trace, "linear", cost_model="pytorch")
    chain_peak = measure_step(model, x, linear.checkpoints, grads="kept", chain=chain).measured_peak_bytes
    graph = build_op_graph(model, x)
    gp = plan_graph(graph.weights, graph.edges)
    dropped = sorted(v for seg in gp.segments for v in seg.interior)
    measured = measure_step(model, x, dropped, grads="kept", chain=graph)
    assert measured.measured_peak_bytes < 0.6 * chain_peak
    assert measured.measured_peak_bytes < 0.6 * measured.baseline_measured_peak_bytes


def test_a_profiling_run_plans_measures_and_applies_the_graph_plan() -> None:
    """``plan MODEL``'s pipeline: the trace carries the op graph, acg's plan is a graph plan measured with a
    real step and a gradient check, and ``apply`` trains the model with it like the unmodified model."""
    from remat.client.apply_plan import applied_chain, apply
    from remat.client.graph.op_graph import OpGraph
    from remat.client.request import ModelRequest
    from remat.worker.pipeline import run

    request = ModelRequest(spec="tests.utils.nas_cell:nas_net", batch_size=2, sample_shape=(3, 16, 16),
                           grads="kept")
    result = run(request, algorithms=["none", "linear", "acg"], timing_rounds=1)
    assert result.trace.graph is not None and result.trace.graph.num_vertices > result.trace.num_stages
    acg = next(p for p in result.plans if p.algorithm == "acg")
    assert acg.is_graph_plan and acg.dropped_vertices and acg.num_vertices == result.trace.graph.num_vertices
    measured = result.measurements["acg"]
    assert measured.dropped_vertices == acg.dropped_vertices and measured.checkpoints == ()
    assert measured.grad_check_passed is True and acg.cost_model == "pytorch"
    # Predicted by replaying the profiled step on the op graph (client/planning/graph_predict.py): exact storage bytes.
    assert measured.predicted_peak_bytes == acg.predicted_peak_bytes
    assert acg.predicted_peak_bytes == pytest.approx(measured.measured_peak_bytes, rel=0.005)
    assert measured.measured_peak_bytes < result.measurements["linear"].measured_peak_bytes
    # Below every chain plan, the graph plan is the frontier's tightest point (NOTE [ budgets below the chains ]):
    # a budget between it and the chains gets it, with acg's measurement (one step, measured once).
    points = sorted((p for p in result.plans if p.budget_bytes), key=lambda p: p.predicted_peak_bytes)
    assert points[0].dropped_vertices == acg.dropped_vertices and points[0].budget_bytes == acg.predicted_peak_bytes
    assert all(not p.is_graph_plan for p in points[1:]) and points[1].predicted_peak_bytes > acg.predicted_peak_bytes
    assert result.measurements[points[0].label].measured_peak_bytes == measured.measured_peak_bytes
    assert result.measurements[points[0].label].dropped_vertices == acg.dropped_vertices
    between = BudgetSpec(text="between", bytes=(acg.predicted_peak_bytes + points[1].predicted_peak_bytes) // 2)
    assert pick_from_frontier(points, between) == points[0]

    torch.manual_seed(1)
    model, reference_model = nas_net().train(), nas_net().train()
    reference_model.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 16, 16)
    apply(model, acg, key=result.key)
    assert isinstance(applied_chain(model), OpGraph)
    for m in (model, reference_model):
        torch.manual_seed(2)
        m(x).square().mean().backward()
    for a, b in zip(model.parameters(), reference_model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)


def test_the_searched_graph_plan_measures_no_higher_than_the_best_chain_plan() -> None:
    """On a ResNet, where the chain plan is hard to beat, ``acg``'s searched plan starts from every chain plan
    (``OpGraph.dropped_for_chain_plan``): measured, it peaks no higher than ``linear``'s, and as predicted."""
    from remat.client.request import ModelRequest
    from remat.worker.pipeline import run

    request = ModelRequest(spec="resnet18", batch_size=2, sample_shape=(3, 32, 32), grads="kept")
    result = run(request, algorithms=["none", "linear", "acg"], timing_rounds=1, check_gradients=False)
    acg = next(p for p in result.plans if p.algorithm == "acg")
    assert acg.is_graph_plan and acg.cost_model == "pytorch"
    measured = result.measurements
    assert measured["acg"].measured_peak_bytes <= measured["linear"].measured_peak_bytes
    assert acg.predicted_peak_bytes == pytest.approx(measured["acg"].measured_peak_bytes, rel=0.005)
    # Stored with the plan: the step's forced memory (NOTE [forced memory]), below what every plan measures.
    assert acg.lower_bound_bytes is not None and acg.extra["lower_bound_at"].startswith(("forward", "backward"))
    assert 0 < acg.lower_bound_bytes <= min(m.measured_peak_bytes for m in measured.values())
    assert 0 <= acg.optimality_gap < 1
    assert Plan.from_dict(acg.to_dict()).lower_bound_bytes == acg.lower_bound_bytes


def test_a_certified_plan_is_the_same_plan_with_a_bound_between_forced_memory_and_its_peak() -> None:
    """The slow path (``certify_s``, a worker's REMAT_CERTIFY_S): the plan is what the fast path plans, and
    it carries a bound over one-level graph plans, never below forced memory nor above the plan, stored."""
    from remat.client.graph.built_model import build
    from remat.client.request import ModelRequest
    from remat.worker import pipeline

    built = build(ModelRequest(spec="resnet18", batch_size=2, sample_shape=(3, 32, 32), grads="kept"))
    trace = pipeline.profile(built)
    fast = next(p for p in pipeline.plans_for(built, trace, algorithms=["acg"]) if p.algorithm == "acg")
    slow = next(p for p in pipeline.plans_for(built, trace, algorithms=["acg"], certify_s=20)
                if p.algorithm == "acg")
    assert fast.certified_bound_bytes is None and fast.certified_gap is None
    assert slow.dropped_vertices == fast.dropped_vertices
    assert slow.lower_bound_bytes <= slow.certified_bound_bytes <= slow.predicted_peak_bytes
    assert 0 <= slow.certified_gap <= slow.optimality_gap
    assert slow.extra["certified_by"].startswith("relaxed step, HiGHS MILP")
    assert Plan.from_dict(slow.to_dict()).certified_bound_bytes == slow.certified_bound_bytes
