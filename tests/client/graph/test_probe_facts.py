"""A stage chain cut from cached probe facts is the chain the probe cuts.

The oracle is ``build_stage_chain`` with its probe run: the chain cut from the same probe's facts, after a
round trip through JSON (what the plan cache stores), must have the same stages, boundaries, dropped cut
vertices, buffer slots, inputs and exports, and train the model exactly like the probed chain. Models are
picked for what the facts carry: in-place writes into boundaries (ReLU(inplace=True), residual adds),
buffers written outside any BatchNorm module, tuple values that cannot be boundaries, shape integers
crossing stages, and nested module names.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable

import pytest
import torch
import torchvision
from torch import nn

from remat.client.graph.stage_graph import StageChain, build_stage_chain, trace_model
from remat.client.graph.write_probe import ProbeFacts, RecordingInterpreter
from tests.client.graph.test_stage_graph import FunctionalNorm, ShapeUser, Tiny

MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "tiny (in-place writes into boundaries)": (Tiny, (2, 3, 8, 8)),
    "functional batch norm (buffers of the root module)": (FunctionalNorm, (2, 3, 8, 8)),
    "shape user (an integer crosses stages)": (ShapeUser, (2, 3, 8, 8)),
    "resnet18": (lambda: torchvision.models.resnet18(num_classes=10), (2, 3, 32, 32)),
    "shufflenet_v2 (tuple values)": (lambda: torchvision.models.shufflenet_v2_x0_5(num_classes=10), (2, 3, 32, 32)),
    "mobilenet_v3_small": (lambda: torchvision.models.mobilenet_v3_small(num_classes=10), (2, 3, 32, 32)),
}


def _structure(chain: StageChain) -> dict[str, object]:
    stages = chain._stages
    return {
        "boundaries": chain.boundaries, "cut_vertices": chain.cut_vertices, "dropped": chain.dropped,
        "nodes": chain.stage_nodes, "inputs": [s.inputs for s in stages], "exports": [s.exports for s in stages],
        "slots": [[(id(m), name) for m, name in s.slots] for s in stages],
        "modules": [[id(m) for m in s.modules] for s in stages],
    }


def _from_json(facts: ProbeFacts | None) -> ProbeFacts:
    assert facts is not None, "the probe's facts could not be named"
    again = ProbeFacts.from_dict(json.loads(json.dumps(facts.to_dict())))
    assert again == facts
    return again


@pytest.mark.parametrize("name", list(MODELS))
def test_a_chain_cut_from_facts_is_the_probed_chain(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    build, shape = MODELS[name]
    torch.manual_seed(0)
    model = build()
    x = torch.randn(shape)
    graph = trace_model(model)
    probed = build_stage_chain(model, x, graph=graph)
    assert probed.probed and probed.num_stages > 1
    facts = _from_json(probed.probe_facts)

    def no_probe(*args: object, **kwargs: object) -> None:
        raise AssertionError("the probe ran although facts were given")

    monkeypatch.setattr(RecordingInterpreter, "run", no_probe)
    cut = build_stage_chain(model, x, graph=graph, facts=facts)
    assert not cut.probed
    assert _structure(cut) == _structure(probed)

    # Same gradients and buffers from both chains with every boundary checkpointed (the recompute of each
    # segment restores exactly the slots the facts name).
    twin = copy.deepcopy(model)
    twin_chain = build_stage_chain(twin, x, graph=trace_model(twin), facts=_from_json(probed.probe_facts))
    every = tuple(range(1, cut.num_stages))
    torch.manual_seed(1)
    probed.run(x, checkpoints=every).sum().backward()
    torch.manual_seed(1)
    twin_chain.run(x, checkpoints=every).sum().backward()
    for (p, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), p
    for (p, a), b in zip(model.named_buffers(), twin.buffers(), strict=True):
        assert torch.equal(a, b), p


def test_buffer_writes_are_named_by_module_path() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 1), FunctionalNorm())
    model[1].conv1 = nn.Conv2d(4, 4, 3, padding=1)
    chain = build_stage_chain(model, torch.randn(2, 3, 8, 8))
    facts = chain.probe_facts
    assert facts is not None
    # The trace holds the buffers its get_attr nodes read on stand-in modules of its own ("graph:1"): the
    # recompute restores both slots.
    assert sorted(s for slots in facts.buffer_writes.values() for s in slots) == [
        ("1", "mean"), ("1", "var"), ("graph:1", "mean"), ("graph:1", "var")]


def _facts(model: nn.Module, x: torch.Tensor) -> ProbeFacts:
    facts = build_stage_chain(model, x).probe_facts
    assert facts is not None
    return facts


@pytest.mark.parametrize("change", ["another graph's nodes", "a missing node", "an unknown module",
                                    "an unknown buffer", "a hit on an unknown node"])
def test_facts_that_do_not_fit_the_graph_are_ignored_and_the_probe_runs(change: str) -> None:
    x = torch.randn(2, 3, 8, 8)
    model = FunctionalNorm()
    facts = _facts(model, x)
    data = facts.to_dict()
    if change == "another graph's nodes":
        data = _facts(Tiny(), x).to_dict()
    elif change == "a missing node":
        data["has_tensor"].pop(next(iter(data["has_tensor"])))
    elif change == "an unknown module":
        data["buffer_writes"] = {node: [["nope", buf] for _, buf in slots]
                                 for node, slots in data["buffer_writes"].items()}
    elif change == "an unknown buffer":
        data["buffer_writes"] = {node: [[mod, "nope"] for mod, _ in slots]
                                 for node, slots in data["buffer_writes"].items()}
    else:
        data["hits"] = [["x", "nope"]]
    wrong = ProbeFacts.from_dict(data)
    assert wrong is not None and wrong != facts
    chain = build_stage_chain(model, x, facts=wrong)
    assert chain.probed and chain.probe_facts == facts


@pytest.mark.parametrize("data", [
    None, [], {"format": "remat-probe-facts/0"},
    {"format": "remat-probe-facts/1", "has_tensor": {}, "is_tensor": {}, "hits": [], "buffer_writes": []},
    {"format": "remat-probe-facts/1", "has_tensor": {"a": 1}, "is_tensor": {}, "hits": [], "buffer_writes": {}},
    {"format": "remat-probe-facts/1", "has_tensor": {}, "is_tensor": {}, "hits": [["a"]], "buffer_writes": {}},
    {"format": "remat-probe-facts/1", "has_tensor": {}, "is_tensor": {}, "hits": [],
     "buffer_writes": {"a": [["m", 3]]}},
])
def test_malformed_facts_read_as_none(data: object) -> None:
    assert ProbeFacts.from_dict(data) is None
