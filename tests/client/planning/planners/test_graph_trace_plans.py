"""``acg`` through the registry on a trace that carries its op graph: a graph plan whose reported figures are
the classic model's as an independent scorer computes them, and a wire form that round-trips."""

from __future__ import annotations

import json

import pytest

from remat.client.errors import PlanError
from remat.client.plan import Plan
from remat.client.planning.planners import PLANNERS
from remat.client.planning.plans import make_plan
from remat.client.trace import TRACE_FORMAT, parse_trace

# Two branches between a stem and a join, each long enough that dropping it is worth the entry it keeps.
WEIGHTS = [64, 100, 40, 300, 300, 40, 300, 300, 50, 8]
EDGES = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 8), (1, 5), (5, 6), (6, 7), (7, 8), (8, 9)]


def _trace(with_graph: bool = True):
    obj = {"format": TRACE_FORMAT, "input_bytes": 64, "model": "branches",
           "stages": [{"name": "stem", "output_bytes": 100, "saved_bytes": 64},
                      {"name": "block", "output_bytes": 50, "saved_bytes": 1280},
                      {"name": "head", "output_bytes": 8, "saved_bytes": 50}]}
    if with_graph:
        obj["graph"] = {"vertices": [{"name": f"v{i}", "bytes": w} for i, w in enumerate(WEIGHTS)],
                        "edges": [list(e) for e in EDGES]}
    return parse_trace(obj)


def _classic(kept: set[int]) -> int | None:
    """Σ kept weights (input and output excluded) + the largest weakly connected dropped group, written here
    from the definition (docs/algorithms.md, `acg`) with a plain flood fill; None when a group has other than one
    kept vertex feeding it and one kept vertex reading it (no single checkpoint call runs it)."""
    n = len(WEIGHTS)
    dropped = set(range(n)) - kept
    neighbours: dict[int, set[int]] = {v: set() for v in range(n)}
    for u, v in EDGES:
        neighbours[u].add(v)
        neighbours[v].add(u)
    largest, seen = 0, set()
    for start in dropped:
        if start in seen:
            continue
        group, stack = {start}, [start]
        seen.add(start)
        while stack:
            v = stack.pop()
            for w in neighbours[v] & dropped - seen:
                seen.add(w)
                group.add(w)
                stack.append(w)
        entries = {u for u, v in EDGES if v in group and u in kept}
        exits = {v for u, v in EDGES if u in group and v in kept}
        if len(entries) != 1 or len(exits) != 1:
            return None
        largest = max(largest, sum(WEIGHTS[v] for v in group))
    return sum(WEIGHTS[v] for v in kept - {0, n - 1}) + largest


def _exhaustive_optimum() -> int:
    n = len(WEIGHTS)
    values = []
    for mask in range(1 << (n - 2)):
        kept = {0, n - 1} | {v + 1 for v in range(n - 2) if mask >> v & 1}
        value = _classic(kept)
        if value is not None:
            values.append(value)
    return min(values)


def test_acg_returns_a_graph_plan_scored_by_the_classic_definition() -> None:
    plan = make_plan(_trace(), "acg", cost_model="pytorch")
    assert plan.is_graph_plan and plan.checkpoints == () and plan.num_vertices == len(WEIGHTS)
    assert plan.cost_model == "classic"  # the only model defined on graphs; said, not hidden
    kept = set(range(len(WEIGHTS))) - set(plan.dropped_vertices or ())
    assert plan.predicted_peak_bytes == _classic(kept)
    assert plan.baseline_peak_bytes == _classic(set(range(len(WEIGHTS))))
    assert plan.predicted_peak_bytes == _exhaustive_optimum() < plan.baseline_peak_bytes
    assert set(plan.dropped_vertices or ()) == {2, 3, 4, 5, 6, 7}  # both branches, each its own group


def test_graph_plan_round_trips_through_json() -> None:
    plan = make_plan(_trace(), "acg")
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


@pytest.mark.parametrize("algorithm", [a for a in PLANNERS if a != "acg"])
def test_chain_planners_ignore_the_graph(algorithm: str) -> None:
    assert make_plan(_trace(), algorithm) == make_plan(_trace(with_graph=False), algorithm)


def test_acg_without_a_graph_plans_the_chain() -> None:
    plan = make_plan(_trace(with_graph=False), "acg")
    assert not plan.is_graph_plan and plan.dropped_vertices is None
    assert plan.checkpoints == make_plan(_trace(with_graph=False), "cubic").checkpoints


@pytest.mark.parametrize(("change", "message"), [
    ({"dropped_vertices": [0]}, "vertex 0 is not in 1..8"),
    ({"dropped_vertices": [9]}, "vertex 9 is not in 1..8"),
    ({"dropped_vertices": [3, 3]}, "listed twice"),
    ({"num_vertices": "10"}, "num_vertices must be an integer"),
    ({"dropped_vertices": "3,4"}, "dropped_vertices must be a list"),
    ({"checkpoints": [1]}, "a graph plan (dropped_vertices) has no chain checkpoints"),
])
def test_malformed_graph_plans_are_named(change: dict, message: str) -> None:
    obj = {**make_plan(_trace(), "acg").to_dict(), **change}
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Plan.from_dict(obj)
