"""remat.client.planning.graph_fit on graph profiles written by hand: which fields it fits, which it relabels,
and what it refuses. The same against real profiles of real models: tests/worker/test_derived_profiles.py."""

from __future__ import annotations

from typing import Any

import pytest

from remat.client.derived_trace import SizeFitError
from remat.client.planning.graph_fit import fit_graph_profiles
from remat.client.planning.graph_predict import GraphProfile


def step(batch: int, *, module_id: int = 140001, first_seq: int = 70, **changes: Any) -> GraphProfile:
    """A two-node step at ``batch``: byte counts ``k * batch`` (plus a constant gradient), the process-dependent
    labels (a slot's module id, the first sequence number) as given."""
    tree: dict[str, Any] = {
        "version": 1, "grads": "kept",
        "nodes": [
            {"name": "conv", "reads": [], "packs": [0], "pack_peaks": [0], "pack_alive": [[]],
             "slots": [[f"{module_id}.running_mean", 256]], "autograd": [0], "peak": 100 * batch, "births": [0],
             "value": [0]},
            {"name": "<loss>", "reads": ["conv"], "packs": [], "pack_peaks": [], "pack_alive": [], "slots": [],
             "autograd": [1], "peak": 4, "births": [], "value": []},
        ],
        "packs": [{"node": "conv", "sid": 0, "consumer": 0}],
        "autograd": [
            {"index": 0, "type": "ConvolutionBackward0", "fx": "conv", "seq": first_seq, "next": [[2, 0]],
             "extra": 8 * batch, "outs": [{"bytes": 1024, "dense": True, "new": 0, "storage": 1024}],
             "inputs": 1, "incoming_sids": [None], "incoming_bytes": [400 * batch], "leftover": 0},
            {"index": 1, "type": "SumBackward0", "fx": "<loss>", "seq": first_seq + 1, "next": [[0, 0]],
             "extra": 0, "outs": [{"bytes": 400 * batch, "dense": True, "new": 0, "storage": 400 * batch}],
             "inputs": 1, "incoming_sids": [None], "incoming_bytes": [4], "leftover": 0},
            {"index": 2, "type": "AccumulateGrad", "fx": "conv", "seq": -1},
        ],
        "sizes": [400 * batch], "root": 1, "root_grad": [4], "param_grad_sids": [],
        "measured_peak": 1200 * batch + 1024,
    }
    tree.update(changes)
    return GraphProfile.from_dict(tree)


def test_byte_counts_follow_the_line_and_labels_become_the_models() -> None:
    fit = fit_graph_profiles([step(2, module_id=9001, first_seq=70), step(4, module_id=5550, first_seq=214)], [2, 4])
    derived = fit.at(9)
    assert derived.storage_bytes == [3600] and derived.nodes[0]["peak"] == 900
    assert derived.autograd[0]["extra"] == 72 and derived.autograd[0]["incoming_bytes"] == [3600]
    assert derived.autograd[1]["outs"][0] == {"bytes": 3600, "dense": True, "new": 0, "storage": 3600}
    assert derived.autograd[0]["outs"][0]["bytes"] == 1024  # a weight's gradient does not grow with the batch
    assert derived.measured_peak_bytes == 1200 * 9 + 1024
    # The order of the sequence numbers is what the replay reads; slots by the order their modules appear.
    assert [r["seq"] for r in derived.autograd] == [0, 1, -1]
    assert derived.nodes[0]["slots"] == [["0.running_mean", 256]]
    assert fit.at(3).storage_bytes == [1200] and fit.at(1).nodes[0]["peak"] == 100


def test_the_fit_at_a_profiled_batch_is_that_profile() -> None:
    profiles = [step(2), step(4), step(6)]
    fit = fit_graph_profiles(profiles[::-1], [6, 4, 2])  # given in any order
    assert fit.sizes == (2, 4, 6)
    for batch, profile in zip((2, 4, 6), profiles, strict=True):
        expected = profile.to_dict()
        got = fit.at(batch).to_dict()
        assert got["sizes"] == expected["sizes"] and got["measured_peak"] == expected["measured_peak"]


def test_a_peak_off_the_line_is_piecewise_through_the_profiles() -> None:
    """A maximum of several terms: the line through its two nearest profiles at each batch, exact at each."""
    fit = fit_graph_profiles([step(2, measured_peak=5000), step(4, measured_peak=5000), step(8, measured_peak=9000)],
                             [2, 4, 8])
    assert [fit.at(b).measured_peak_bytes for b in (3, 4, 6, 8, 10)] == [5000, 5000, 7000, 9000, 11000]


@pytest.mark.parametrize("changes, message", [
    ({"root": 0}, r"graph profile\.root: differs between the batch sizes \(2: 1, 4: 0\); only byte counts may"),
    ({"packs": [{"node": "conv", "sid": 0, "consumer": 1}]},
     r"graph profile\.packs\[0\]\.consumer: differs between the batch sizes"),
    ({"sizes": [1, 2]}, r"graph profile\.sizes: its length differs between the batch sizes \[2, 4\] \(1, 2\)"),
    ({"grads": "none"}, r"graph profile\.grads: differs"),
])
def test_profiles_of_different_steps_are_refused_naming_the_record(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(SizeFitError, match=message):
        fit_graph_profiles([step(2), step(4, **changes)], [2, 4])


def test_a_different_order_of_autograd_nodes_is_refused() -> None:
    """Sequence numbers may be shifted (a process-wide counter), not reordered: the engine's order is the step's."""
    swapped = step(4)
    autograd = [dict(r) for r in swapped.autograd]
    autograd[0]["seq"], autograd[1]["seq"] = 71, 70
    with pytest.raises(SizeFitError, match=r"graph profile\.autograd\[0\]\.seq: differs"):
        fit_graph_profiles([step(2), GraphProfile.from_dict({**swapped.to_dict(), "autograd": autograd})], [2, 4])


@pytest.mark.parametrize("sizes", [[2], [2, 2]])
def test_one_batch_size_is_not_a_fit(sizes: list[int]) -> None:
    with pytest.raises(SizeFitError, match=r"need two or more different batch sizes"):
        fit_graph_profiles([step(2)] * len(sizes), sizes)
