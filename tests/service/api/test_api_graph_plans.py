"""Graph plans through the service: a trace carrying its op graph is stored with it, ``acg``'s graph plan is
served and measured like a chain plan, and the graph's size is bounded."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

from remat.service import repository
from tests.service.factories import AUTH, trace_dict

QUERY = {"input_shape": "8,3,32,32", "dtype": "float32", "device": "cpu"}


def _diamonds(blocks: int) -> dict[str, Any]:
    """A stem then ``blocks`` diamonds (two arms joined), as a ``graph`` field: 1 + 3·blocks + 1 vertices."""
    vertices = [{"name": "<input>", "bytes": 4096}]
    edges = []
    join = 0
    for b in range(blocks):
        left, right, nxt = join + 1, join + 2, join + 3
        vertices += [{"name": f"b{b}.left", "bytes": 9000}, {"name": f"b{b}.right", "bytes": 7000},
                     {"name": f"b{b}.add", "bytes": 3000}]
        edges += [[join, left], [join, right], [left, nxt], [right, nxt]]
        join = nxt
    vertices.append({"name": "loss-head", "bytes": 40})
    edges.append([join, join + 1])
    return {"vertices": vertices, "edges": edges}


def test_a_graph_trace_stores_its_graph_and_serves_acgs_graph_plan(client: TestClient, db) -> None:
    body = {**trace_dict(), "graph": _diamonds(4)}
    stored = client.post("/v1/traces", json=body, headers=AUTH)
    assert stored.status_code == 201, stored.text
    acg = next(p for p in stored.json()["plans"] if p["algorithm"] == "acg")
    assert acg["num_vertices"] == 14 and acg["checkpoints"] == [] and acg["cost_model"] == "classic"
    assert acg["dropped_vertices"]  # both arms of a diamond are worth dropping
    served = client.get("/v1/plans/arch-1", params={**QUERY, "algorithm": "acg"})
    assert served.status_code == 200, served.text
    assert served.json()["plan"]["dropped_vertices"] == acg["dropped_vertices"]
    linear = client.get("/v1/plans/arch-1", params={**QUERY, "algorithm": "linear"}).json()["plan"]
    assert "dropped_vertices" not in linear or linear["dropped_vertices"] is None
    with db.read_session() as session:  # the stored trace reads back with its graph (the worker replans from it)
        trace = repository.load_trace(session=session, trace_id=stored.json()["trace_id"])
    assert trace is not None and trace.graph is not None and trace.graph.to_dict() == body["graph"]


def test_a_graph_plans_measurement_is_kept_while_its_vertices_are_the_plans(client: TestClient) -> None:
    client.post("/v1/traces", json={**trace_dict(), "graph": _diamonds(3)}, headers=AUTH)
    plan = client.get("/v1/plans/arch-1", params={**QUERY, "algorithm": "acg"}).json()["plan"]
    key = {"model_hash": "arch-1", "input_shape": [8, 3, 32, 32], "dtype": "float32", "device": "cpu"}
    stale = {"key": key, "algorithm": "acg", "measured_peak_bytes": 1, "dropped_vertices": [1]}
    current = {"key": key, "algorithm": "acg", "measured_peak_bytes": 20000}
    for measurement in (stale, current):
        assert client.post("/v1/measurements", json=measurement, headers=AUTH).status_code == 201
    measured = client.get("/v1/plans/arch-1", params={**QUERY, "algorithm": "acg"}).json()["measurements"]
    assert [m["measured_peak_bytes"] for m in measured] == [20000]  # the plan's own vertices, not [1]
    assert measured[0]["dropped_vertices"] == plan["dropped_vertices"]


def test_a_graph_past_the_vertex_limit_is_refused_naming_it(make_client: Callable[..., TestClient]) -> None:
    client = make_client(max_graph_vertices=13)
    assert client.post("/v1/traces", json={**trace_dict(), "graph": _diamonds(3)}, headers=AUTH).status_code == 201
    past = client.post("/v1/traces", json={**trace_dict(model_hash="arch-2"), "graph": _diamonds(4)}, headers=AUTH)
    assert past.status_code == 422
    assert past.json()["detail"].startswith("graph.vertices: 14 vertices, more than the 13 this service plans "
                                            "(REMAT_MAX_GRAPH_VERTICES)")


def test_a_bad_graph_is_a_422_naming_the_field(client: TestClient) -> None:
    graph = _diamonds(2)
    graph["edges"].append([5, 2])
    response = client.post("/v1/traces", json={**trace_dict(), "graph": graph}, headers=AUTH)
    assert response.status_code == 422
    assert response.json()["detail"].startswith("graph.edges[9]: [5, 2] must satisfy")
