"""The graph predictor against measured steps: one profile of the unmodified model predicts any plan's peak.

Small models: the DARTS-like cells (branches crossing inside cells, recompute peaks), a
ResNet-18 at 32x32 (in-place ReLUs, residual adds: a gradient passed on as the same tensor) and a small
DenseNet (concatenations: gradients as views of one buffer, accumulated out of place). Each plan is
predicted from the profile alone and measured with ``measure_step``; CPU storage bytes are exact, so the
tolerance is tight (0.5%).
"""

from __future__ import annotations

import copy
import functools
import json
import random

import pytest
import torch
import torchvision

from remat.client.errors import PlanError
from remat.client.graph.op_graph import build_op_graph
from remat.client.planning.graph_predict import GraphProfile, predict_graph_peak, search_plan
from remat.client.planning.planners.acg import plan_graph
from remat.worker.graph_profile import executor_units, profile_graph
from remat.worker.measure import measure_step
from tests.utils.nas_cell import nas_net

TOLERANCE = 0.005

MODELS = {
    "nas_cells": (lambda: nas_net(cells=3), (2, 3, 16, 16)),
    "resnet18": (lambda: torchvision.models.resnet18(weights=None), (2, 3, 32, 32)),
    "densenet_small": (lambda: torchvision.models.DenseNet(growth_rate=8, block_config=(2, 3), num_init_features=16,
                                                           bn_size=2, num_classes=10), (2, 3, 32, 32)),
}


def _plans(graph, count: int = 2) -> dict[str, list[int]]:
    gp = plan_graph(graph.weights, graph.edges)
    plans = {"none": [], "acg": sorted(v for seg in gp.segments for v in seg.interior)}
    rng = random.Random(0)
    for k in range(count):  # acg on perturbed weights: large, structured dropped sets
        w = [int(x * rng.uniform(0.05, 3.0)) for x in graph.weights]
        plans[f"perturbed{k}"] = sorted(v for seg in plan_graph(w, graph.edges).segments for v in seg.interior)
    tries = 0
    while sum(k.startswith("uniform") for k in plans) < count and tries < 500:
        tries += 1
        d = sorted(rng.sample(range(1, graph.sink), rng.randint(1, max(1, (graph.sink - 1) // 3))))
        try:
            executor_units(graph, d)
        except PlanError:
            continue
        plans[f"uniform{tries}"] = d
    return plans


def _profiled(name: str) -> tuple:
    """One of MODELS on one thread: the model, its input, its op graph and one profiled step."""
    torch.set_num_threads(1)
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make().train()
    x = torch.randn(*shape)
    graph = build_op_graph(model, x)
    return model, x, graph, profile_graph(model, x, graph, grads="kept")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_predicted_peaks_match_measured(name: str) -> None:
    model, x, graph, profile = _profiled(name)
    assert GraphProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile  # torch-free, storable
    for label, dropped in _plans(graph).items():
        predicted = predict_graph_peak(profile, executor_units(graph, dropped))
        measured = measure_step(model, x, dropped, grads="kept", chain=graph, baseline=False,
                                timing_repeats=0).measured_peak_bytes
        assert abs(predicted.peak / measured - 1) <= TOLERANCE, (label, predicted, measured)
        assert predicted.unexplained == 0


def _profiled_cells() -> tuple:
    """Two DARTS-like cells at 16x16: the model, its input, its op graph and one profiled step."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nas_net(cells=2).train()
    x = torch.randn(2, 3, 16, 16)
    graph = build_op_graph(model, x)
    return model, x, graph, profile_graph(model, x, graph, grads="kept")


def test_profile_run_is_the_measured_step() -> None:
    """The instrumentation (hooks, detached packs) changes no allocation: its own peak is the measured one."""
    model, x, graph, profile = _profiled_cells()
    measured = measure_step(model, x, (), grads="kept", chain=graph, baseline=False, timing_repeats=0)
    assert profile.measured_peak_bytes == measured.measured_peak_bytes


def test_search_never_predicts_above_acg_and_its_plan_measures_as_predicted() -> None:
    model, x, graph, profile = _profiled_cells()
    units_of = functools.partial(executor_units, graph)
    acg = sorted(v for seg in plan_graph(graph.weights, graph.edges).segments for v in seg.interior)
    result = search_plan(profile, graph.weights, graph.edges, units_of, vertex_nodes=graph.vertex_nodes,
                         max_evaluations=150)
    assert result.prediction.peak <= predict_graph_peak(profile, units_of(acg)).peak
    again = search_plan(profile, graph.weights, graph.edges, units_of, vertex_nodes=graph.vertex_nodes,
                        max_evaluations=150)
    assert (again.dropped, again.prediction.peak) == (result.dropped, result.prediction.peak)  # no luck, no clock
    measured = measure_step(model, x, result.dropped, grads="kept", chain=graph, baseline=False,
                            timing_repeats=0).measured_peak_bytes
    assert abs(result.prediction.peak / measured - 1) <= TOLERANCE


def test_graph_profile_wire_format_is_the_dict_profile_graph_returned() -> None:
    """``to_dict`` writes the keys the untyped record had, in its order, and ``from_dict`` reads them back;
    a record from before ``param_grad_sids`` reads as none, another version is refused."""
    wire = {"version": 1, "grads": "none", "nodes": [], "packs": [], "autograd": [], "sizes": [4, 8], "root": 0,
            "root_grad": [4], "param_grad_sids": [1], "measured_peak": 12}
    profile = GraphProfile.from_dict(json.loads(json.dumps(wire)))
    assert (profile.storage_bytes, profile.root_grad_bytes, profile.measured_peak_bytes) == ([4, 8], [4], 12)
    assert json.dumps(profile.to_dict()) == json.dumps(wire)
    older = {k: v for k, v in wire.items() if k != "param_grad_sids"}
    assert GraphProfile.from_dict(older).param_grad_sids == []
    with pytest.raises(ValueError, match="version"):
        GraphProfile.from_dict({**wire, "version": 2})


def test_groups_and_cuts_of_a_dense_block() -> None:
    """A dense block: x0 → a, b, c, each layer reading every earlier feature, c the exit. Keeping the cut at
    a splits the call in two; the cut after b is every feature b's successors still read."""
    from remat.client.planning.graph_predict import call_groups, group_cuts

    # 0 input, 1 a, 2 b, 3 c, 4 sink; 1, 2, 3 read everything before them.
    succ = [{1, 2, 3}, {2, 3}, {3}, {4}, set()]
    assert call_groups([1, 2], succ) == [[1, 2]]
    assert call_groups([1, 3], succ) == [[1, 3]]  # 1 → 3 is an edge: one call
    assert group_cuts([1, 2, 3], succ) == [frozenset({1}), frozenset({1, 2})]
    # A chain's group: each position's cut is the one vertex that crosses it.
    chain = [{1}, {2}, {3}, {4}, set()]
    assert call_groups([1, 3], chain) == [[1], [3]]
    assert group_cuts([1, 2, 3], chain) == [frozenset({1}), frozenset({2})]


def test_a_chain_plan_as_a_graph_plan_measures_like_the_chain_plan() -> None:
    """``OpGraph.dropped_for_chain_plan``: the search's seeds are the chain planners' plans; run on the op graph
    they keep what the chain keeps, so the step measures the chain plan's peak and trains the same."""
    from remat.client.graph.stage_graph import build_stage_chain

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).train()
    x = torch.randn(2, 3, 32, 32)
    chain = build_stage_chain(model, x, train=True)
    graph = build_op_graph(model, x, graph=chain.graph_module)
    checkpoints = (2, 5, 7)
    dropped = graph.dropped_for_chain_plan(chain.stage_nodes, chain.boundaries, checkpoints)
    assert dropped and graph.sink not in dropped and 0 not in dropped
    on_chain = measure_step(model, x, checkpoints, grads="kept", chain=chain, baseline=False, timing_repeats=0)
    on_graph = measure_step(model, x, dropped, grads="kept", chain=graph, baseline=False, timing_repeats=0)
    assert on_graph.measured_peak_bytes == pytest.approx(on_chain.measured_peak_bytes, rel=TOLERANCE)
    assert len(graph.calls(dropped)) == len(checkpoints)  # one call per checkpointed segment


def test_a_dense_chain_plan_as_a_graph_plan_keeps_the_features_it_hands_on() -> None:
    """A checkpointed segment of a dense block returns the features later layers read (side values): as a
    graph plan they stay kept, so the step peaks no higher than the chain plan's (whose segments are handed
    every feature made so far, the graph's calls only those they read) and trains bit-equal."""
    from remat.client.graph.stage_graph import build_stage_chain

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torchvision.models.DenseNet(growth_rate=4, block_config=(4, 3), num_init_features=8, bn_size=2,
                                        num_classes=5).train()
    x = torch.randn(2, 3, 32, 32)
    chain = build_stage_chain(model, x, train=True)
    graph = build_op_graph(model, x, graph=chain.graph_module)
    n = chain.num_stages
    checkpoints = tuple(range(3, n, 4))
    dropped = graph.dropped_for_chain_plan(chain.stage_nodes, chain.boundaries, checkpoints)
    side_vertices = {graph._vertex_of_node[name] for name in chain.side_values}
    assert dropped and not side_vertices & set(dropped)
    on_chain = measure_step(model, x, checkpoints, grads="kept", chain=chain, baseline=False, timing_repeats=0)
    on_graph = measure_step(model, x, dropped, grads="kept", chain=graph, baseline=False, timing_repeats=0)
    assert on_graph.measured_peak_bytes <= on_chain.measured_peak_bytes
    model.zero_grad(set_to_none=True)
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    reference(x).square().sum().backward()
    torch.manual_seed(1)
    graph.run(x, dropped).square().sum().backward()
    for (name, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forced_memory_is_below_every_plan_predicted_and_measured(name: str) -> None:
    """NOTE [forced memory]: no plan goes below ``forced_peak``, predicted (random and structured plans, the
    search's) nor measured (the step itself, an oracle the bound never saw)."""
    from remat.client.planning.graph_predict import forced_peak

    model, x, graph, profile = _profiled(name)
    bound = forced_peak(profile)
    assert 0 < bound.peak < profile.measured_peak_bytes and bound.where != "nothing"
    units_of = functools.partial(executor_units, graph)
    plans = _plans(graph, count=8)
    plans["searched"] = search_plan(profile, graph.weights, graph.edges, units_of, vertex_nodes=graph.vertex_nodes,
                                    max_evaluations=150).dropped
    for label, dropped in plans.items():
        assert predict_graph_peak(profile, units_of(dropped)).peak >= bound.peak, label
    for label in ("searched", "perturbed0"):
        measured = measure_step(model, x, plans[label], grads="kept", chain=graph, baseline=False,
                                timing_repeats=0).measured_peak_bytes
        assert measured >= bound.peak, label


@pytest.mark.parametrize("name", ["densenet_small", "resnet18"])
def test_stopped_replays_leave_the_search_as_whole_replays_do(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ replays stopped above the running ]: stopping a move's replay once it cannot be among the moves the
    descent looks at changes nothing the search decides. The oracle is the same search with every plan replayed
    to the end (the judge's bar taken away): the same plan, prediction, trail and count of plans judged; and
    replays were stopped, or this would compare a search with itself."""
    from remat.client.planning import graph_predict

    _, _, graph, profile = _profiled(name)
    units_of = functools.partial(executor_units, graph)
    stopped_replays = []
    simulate = graph_predict._simulate

    def counting(*args: object, **kwargs: object) -> graph_predict.Prediction:
        try:
            return simulate(*args, **kwargs)
        except graph_predict._AbovePeak:
            stopped_replays.append(args[1])
            raise

    def searched() -> graph_predict.SearchResult:
        return search_plan(profile, graph.weights, graph.edges, units_of, vertex_nodes=graph.vertex_nodes,
                           max_evaluations=300)

    monkeypatch.setattr(graph_predict, "_simulate", counting)
    stopped = searched()
    assert stopped_replays
    judge = graph_predict._Judge.__call__
    monkeypatch.setattr(graph_predict._Judge, "__call__", lambda self, dropped, above=None: judge(self, dropped))
    whole = searched()
    assert (stopped.dropped, stopped.prediction, stopped.source, stopped.trail, stopped.evaluated) == \
        (whole.dropped, whole.prediction, whole.source, whole.trail, whole.evaluated)


def test_a_stopped_plan_counts_once_and_is_replayed_whole_when_asked_again() -> None:
    """The judge's bounds: a plan stopped above a bar is judged (counted) once, its bound is no more than its
    peak, and asked again with a higher bar or none it gets the prediction of a whole replay, uncounted."""
    from remat.client.planning.graph_predict import _Judge

    _, _, graph, profile = _profiled("resnet18")
    units_of = functools.partial(executor_units, graph)
    dropped = _plans(graph)["acg"]
    exact = predict_graph_peak(profile, units_of(dropped))
    judge = _Judge(profile, units_of, limit=10)
    assert judge(dropped, above=exact.peak // 2) is None
    assert judge.count == 1 and exact.peak // 2 < judge.bounds[tuple(dropped)] <= exact.peak
    assert judge(dropped, above=judge.bounds[tuple(dropped)] - 1) is None  # still above the bar: not replayed
    assert judge(dropped) == exact and judge.count == 1 and not judge.bounds
    assert judge(dropped, above=0) == exact  # known whole: no bar hides it
