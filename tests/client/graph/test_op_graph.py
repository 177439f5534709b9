"""Op graphs: vertices and their sizes, the chain's boundaries among them, and graph plans that train exactly
like the unmodified model (gradients, outputs and BatchNorm buffers bit-identical on CPU)."""

from __future__ import annotations

import random

import pytest
import torch
import torchvision
from torch import nn

from remat.client.errors import PlanError
from remat.client.graph.op_graph import OpGraph, build_op_graph
from remat.client.graph.stage_graph import build_stage_chain
from tests.client.graph.test_stage_graph import Tiny
from tests.utils.nas_cell import nas_net


class CrossedDropout(nn.Module):
    """Two branches whose dropouts interleave in graph order: running branch 1 as one call would move its
    dropout before branch 2's."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3, self.l4 = (nn.Linear(4, 4) for _ in range(4))
        self.d1, self.d2 = nn.Dropout(0.5), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.l1(x)
        b = self.d2(self.l2(x))
        return self.l4(self.d1(self.l3(a))) + b


def _vertex_of(graph: OpGraph, node: str) -> int:
    return next(v for v, names in enumerate(graph.vertex_nodes) if node in names)


def test_vertices_fuse_in_place_writers_and_views_and_weigh_new_storages() -> None:
    model = Tiny()
    graph = build_op_graph(model, torch.randn(2, 3, 5, 5))
    assert graph.vertex_nodes[0] == ("x",)
    # bn1 is rewritten by the in-place ReLU module; the residual add by the in-place functional relu.
    assert _vertex_of(graph, "bn1") == _vertex_of(graph, "relu")
    assert _vertex_of(graph, "add") == _vertex_of(graph, "relu_1")
    # flatten is a view of the pooled tensor: keeping it keeps the pool's storage.
    assert _vertex_of(graph, "flatten") == _vertex_of(graph, "pool")
    act = 2 * 4 * 5 * 5 * 4  # one (2, 4, 5, 5) float32 activation
    by_vertex = dict(zip(graph.vertex_nodes, graph.weights, strict=True))
    assert by_vertex[("conv1",)] == act
    assert by_vertex[("bn1", "relu")] == act
    assert by_vertex[("add", "relu_1")] == act
    assert by_vertex[("pool", "flatten")] == 2 * 4 * 4
    assert by_vertex[("fc",)] == 2 * 2 * 4
    assert graph.weights[0] == 2 * 3 * 5 * 5 * 4
    assert all(u < v for u, v in graph.edges)
    # conv2 and the residual both read bn1's vertex: two edges into the add's vertex's ancestry
    x1, c2, c3, add = (_vertex_of(graph, n) for n in ("bn1", "conv2", "conv3", "add"))
    assert {(x1, c2), (c2, c3), (c3, add), (x1, add)} <= set(graph.edges)
    assert not graph.virtual_sink and graph.sink == _vertex_of(graph, "fc")


def _splits(graph: OpGraph, v: int) -> bool:
    """Brute force: does removing vertex ``v`` disconnect the source from the sink?"""
    succ: dict[int, list[int]] = {}
    for a, b in graph.edges:
        succ.setdefault(a, []).append(b)
    seen, stack = {0}, [0]
    while stack:
        for b in succ.get(stack.pop(), ()):
            if b != v and b not in seen:
                seen.add(b)
                stack.append(b)
    return graph.sink not in seen


@pytest.mark.parametrize("name", ["resnet18", "densenet121", "mobilenet_v2"])
def test_every_chain_boundary_is_a_splitting_vertex_of_the_op_graph(name: str) -> None:
    model = getattr(torchvision.models, name)(weights=None)
    x = torch.randn(2, 3, 32, 32)
    chain = build_stage_chain(model, x)
    graph = build_op_graph(model, x)
    assert chain.boundaries
    side = {_vertex_of(graph, name) for name in chain.side_values}
    dense_cuts = 0
    for boundary in chain.boundaries:
        v = _vertex_of(graph, boundary)
        if not _splits(graph, v):
            # Inside a dense block (NOTE [side values]): only side values' edges jump over the boundary.
            assert {a for a, b in graph.edges if a < v < b} <= side, boundary
            dense_cuts += 1
    assert (dense_cuts > 0) == (name == "densenet121")
    # and the graph is finer: it has vertices inside the chain's stages
    assert graph.num_vertices > chain.num_stages + 1


def test_auxiliary_outputs_meet_in_a_gathering_sink_of_weight_zero() -> None:
    model = torchvision.models.googlenet(weights=None, aux_logits=True, init_weights=False)
    graph = build_op_graph(model, torch.randn(2, 3, 64, 64))
    sink = graph.sink
    readers = {a for a, b in graph.edges if b == sink}
    assert graph.weights[sink] == 0
    assert {graph.vertex_nodes[r][-1] for r in readers} == {"aux1_fc2", "aux2_fc2", "fc"}


def _valid_random_plan(graph: OpGraph, rng: random.Random, share: float) -> list[int]:
    """Random dropped vertices; a group that cannot run as one checkpointed call gives up random members
    (they are kept) until every group can."""
    dropped = {v for v in range(1, graph.sink) if rng.random() < share}
    while True:
        for group in graph.groups(sorted(dropped)):
            try:
                graph.check(group)
            except PlanError:
                dropped.discard(rng.choice(group))
                break
        else:
            return sorted(dropped)


def _step(model: nn.Module, x: torch.Tensor, forward) -> tuple[list, list, list]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    out = forward(x)
    outs = list(out) if isinstance(out, tuple) else [out]
    sum(o.float().pow(2).mean() for o in outs).backward()
    return ([o.detach() for o in outs], [p.grad for p in model.parameters()],
            [b.clone() for b in model.buffers()])


def _same(a: list, b: list, rtol: float = 0.0) -> bool:
    def close(x: torch.Tensor | None, y: torch.Tensor | None) -> bool:
        if x is None or y is None:
            return x is None and y is None
        return torch.equal(x, y) if rtol == 0 else torch.allclose(x, y, rtol=rtol, atol=rtol * y.abs().max().item())

    return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b, strict=True))


def _contiguous(graph: OpGraph, dropped: list[int]) -> bool:
    """Whether every call's nodes are consecutive in the traced order (so nothing is reordered)."""
    order = {n.name: i for i, n in enumerate(graph.graph_module.graph.nodes)}
    for group in graph.calls(dropped):
        spots = sorted(order[name] for v in group for name in graph.vertex_nodes[v])
        if spots[-1] - spots[0] + 1 != len(spots):
            return False
    return True


MODELS = {
    "resnet18": (lambda: torchvision.models.resnet18(weights=None), (2, 3, 32, 32)),
    "densenet121": (lambda: torchvision.models.densenet121(weights=None), (2, 3, 32, 32)),
    "googlenet": (lambda: torchvision.models.googlenet(weights=None, aux_logits=True, init_weights=False),
                  (2, 3, 64, 64)),
    "inception_v3": (lambda: torchvision.models.inception_v3(weights=None, aux_logits=True, init_weights=False),
                     (2, 3, 299, 299)),
    "nas_cells": (nas_net, (2, 3, 16, 16)),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_graph_plans_train_exactly_like_the_model(name: str) -> None:
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make().train()
    x = torch.randn(*shape)
    graph = build_op_graph(model, x)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    reference = _step(model, x, model)
    rng = random.Random(name)
    plans = [_valid_random_plan(graph, rng, share) for share in (0.3, 0.6, 0.9)]
    assert any(len(p) > graph.sink // 4 for p in plans), "the random plans drop too little to test anything"
    for dropped in plans:
        model.load_state_dict(initial)
        outputs, grads, buffers = _step(model, x, lambda t, d=dropped: graph.run(t, d))
        assert _same(outputs, reference[0]), dropped
        assert _same(buffers, reference[2]), dropped
        # A group whose nodes the traced order interleaves with kept ones is created earlier than some of
        # them, so autograd sums the gradient of a tensor read by both in another order: equal up to float
        # rounding. With every group contiguous nothing moves and gradients are bit-identical.
        assert _same(grads, reference[1], rtol=0.0 if _contiguous(graph, dropped) else 1e-4), dropped


def test_a_group_read_and_fed_by_a_kept_vertex_is_refused() -> None:
    graph = build_op_graph(Tiny(), torch.randn(2, 3, 5, 5))
    conv2, conv3, add = (_vertex_of(graph, n) for n in ("conv2", "conv3", "add"))
    bn1 = _vertex_of(graph, "bn1")
    # conv1 and the add, joined through nothing dropped? Drop bn1's vertex and the add: conv2/conv3 kept
    # read bn1 and feed the add, so the group {bn1, add} would have to run before and after them.
    with pytest.raises(PlanError, match="no single checkpointable group"):
        graph.run(torch.randn(2, 3, 5, 5), [bn1, add])
    graph.check([conv2, conv3])  # a run inside the residual branch is fine


def test_a_plan_that_would_reorder_random_ops_is_refused() -> None:
    model = CrossedDropout().train()
    graph = build_op_graph(model, torch.randn(3, 4))
    l1, d1, l3 = (_vertex_of(graph, n) for n in ("l1", "d1", "l3"))
    with pytest.raises(PlanError, match="reorder random ops"):
        graph.run(torch.randn(3, 4), [l1, d1, l3])
    # The order the graph predictor replays refuses it too: a plan search never picks what cannot run.
    with pytest.raises(PlanError, match="reorder random ops"):
        graph.execution_order([l1, d1, l3])


def test_bad_dropped_vertices_are_refused_in_one_line() -> None:
    graph = build_op_graph(Tiny(), torch.randn(2, 3, 5, 5))
    for bad in ([0], [graph.sink], [1, 1], [True]):
        with pytest.raises(PlanError, match="must be distinct vertices"):
            graph.run(torch.randn(2, 3, 5, 5), bad)


def test_building_leaves_the_model_untouched() -> None:
    model = torchvision.models.resnet18(weights=None).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 32, 32)
    torch.manual_seed(123)
    rng_before = torch.get_rng_state()
    build_op_graph(model, x)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
