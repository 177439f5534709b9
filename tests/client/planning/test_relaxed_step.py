"""The relaxed step (NOTE [relaxed step]) against the graph predictor: below every plan a search judges, and a
MILP bound between the step's forced memory and the best plan found.

The oracle is the predictor itself (``predict_graph_peak``, checked against measured steps in
test_graph_predict): the relaxation is written from the executor's rules, not from the predictor's ledger.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat.client.errors import PlanError
from remat.client.graph.op_graph import build_op_graph
from remat.client.planning.graph_predict import forced_peak, predict_graph_peak, search_plan
from remat.client.planning.relaxed_step import Relaxation, certified_bound, relaxed_peak
from remat.worker.graph_profile import executor_units, profile_graph
from tests.client.planning.test_graph_predict import MODELS, _plans


def _conv_chain() -> nn.Module:
    """Twelve small conv blocks on a large image: activations dwarf weights, so the peak is a trade between
    what forward keeps and what backward re-runs, which forced memory cannot see."""
    layers: list[nn.Module] = []
    for _ in range(12):
        layers += [nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))


class _TwoBranches(nn.Module):
    """Two conv branches from one stem, added: a call that drops the block re-runs both branches before the
    add, so their packs are alive together."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(4, 4, 3, padding=1)
        self.left, self.right = (nn.Sequential(*[m for _ in range(3) for m in (
            nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())]) for _ in range(2))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        return self.head(self.left(x) + self.right(x))


CASES = {**MODELS, "conv_chain": (_conv_chain, (4, 4, 32, 32)), "two_branches": (_TwoBranches, (4, 4, 32, 32))}


def _judged(name: str, evaluations: int = 150) -> tuple:
    """A profiled model of CASES and every plan a search judged on it, with its predicted peak."""
    torch.set_num_threads(1)
    make, shape = CASES[name]
    torch.manual_seed(0)
    model, x = make().train(), torch.randn(*shape)
    graph = build_op_graph(model, x)
    profile = profile_graph(model, x, graph, grads="kept")
    tried: list[tuple[int, ...]] = []

    def units_of(dropped):
        tried.append(tuple(dropped))
        return executor_units(graph, dropped)

    search_plan(profile, graph.weights, graph.edges, units_of, vertex_nodes=graph.vertex_nodes,
                max_evaluations=evaluations)
    peaks = {}
    for dropped in {*tried, *(tuple(d) for d in _plans(graph, count=4).values())}:
        try:
            peaks[dropped] = predict_graph_peak(profile, executor_units(graph, dropped)).peak
        except PlanError:
            continue
    return graph, profile, peaks


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_relaxed_peak_is_below_every_plan_the_search_judged(name: str) -> None:
    graph, profile, peaks = _judged(name)
    relax = Relaxation.of(profile, graph.vertex_nodes, graph.edges)
    assert len(peaks) > 20
    for dropped, peak in peaks.items():
        relaxed, where = relaxed_peak(relax, dropped)
        assert relaxed <= peak, (dropped, where)
    # It is not vacuous: with nothing dropped the relaxed step sees most of what the step holds.
    assert relaxed_peak(relax, ())[0] >= 0.5 * peaks[()]


def test_a_re_run_counts_every_branch_of_its_call() -> None:
    """Dropping the whole two-branch block, its re-run holds both branches' packs at the add: the relaxed step
    sees both (a longest path alone sees about half, 0.53 of the peak), and stays below the predictor."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, x = _TwoBranches().train(), torch.randn(4, 4, 32, 32)
    graph = build_op_graph(model, x)
    profile = profile_graph(model, x, graph, grads="kept")
    add = next(v for v, names in enumerate(graph.vertex_nodes) if names == ("add",))
    first = next(v for v, names in enumerate(graph.vertex_nodes) if names == ("left_0",))
    dropped = list(range(first, add + 1))
    predicted = predict_graph_peak(profile, executor_units(graph, dropped))
    assert "recompute" in predicted.where
    relaxed, where = relaxed_peak(Relaxation.of(profile, graph.vertex_nodes, graph.edges), dropped)
    assert 0.75 * predicted.peak <= relaxed <= predicted.peak, where


def test_the_certified_bound_lies_between_forced_memory_and_every_plan() -> None:
    """On a chain whose peak is a trade, the MILP proves more than forced memory (more than twice as much) and
    no more than any plan judged."""
    graph, profile, peaks = _judged("conv_chain")
    forced = forced_peak(profile).peak
    cert = certified_bound(Relaxation.of(profile, graph.vertex_nodes, graph.edges), floor=forced, seconds=60)
    assert cert.optimal and cert.dropped is not None
    assert 2 * forced < cert.bound <= min(peaks.values())
    assert cert.relaxed_best is not None and cert.bound <= cert.relaxed_best


def test_the_certified_bound_never_goes_below_its_floor() -> None:
    """A floor above what the relaxation proves (the search's own best plan) comes back as the bound."""
    graph, profile, peaks = _judged("resnet18", evaluations=40)
    best = min(peaks.values())
    cert = certified_bound(Relaxation.of(profile, graph.vertex_nodes, graph.edges), floor=best, seconds=10)
    assert cert.bound == best
