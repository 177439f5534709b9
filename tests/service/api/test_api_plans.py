"""GET /v1/plans/{model_hash} through the cache, GET /v1/plans, POST /v1/measurements."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
from fastapi.testclient import TestClient

from remat.client.planning.planners import PLANNERS
from tests.service.factories import AUTH, REDIS_URL, closed_port_url, trace_dict

QUERY = {"input_shape": "8,3,32,32", "dtype": "float32", "device": "cpu"}
MEASURED = {"key": {"model_hash": "arch-1", "input_shape": [8, 3, 32, 32], "dtype": "float32", "device": "cpu"},
            "algorithm": "linear", "measured_peak_bytes": 123456, "measured_reserved_bytes": 200000,
            "step_ms": 12.5, "grad_check_passed": True, "device_name": "test-cpu"}


@pytest.fixture
def cached_client(make_client: Callable[..., TestClient], redis_prefix: str) -> TestClient:
    return make_client(redis_url=REDIS_URL, cache_prefix=redis_prefix)


def test_read_plan_with_prediction_and_provenance(client: TestClient) -> None:
    client.post("/v1/traces", json=trace_dict(device_name="Test CPU", torch_version="2.5.1"), headers=AUTH)
    response = client.get("/v1/plans/arch-1", params=QUERY)
    assert response.status_code == 200
    body = response.json()
    assert body["plan"]["algorithm"] == "linear" and body["plan"]["num_stages"] == 6
    assert body["plan"]["predicted_peak_bytes"] <= body["plan"]["baseline_peak_bytes"]
    assert body["trace"]["torch_version"] == "2.5.1" and body["trace"]["model"] == "tiny-net"
    assert body["measurements"] == []
    for algorithm in ("none", "cubic", "chen-sqrt"):
        assert client.get("/v1/plans/arch-1", params={**QUERY, "algorithm": algorithm}).status_code == 200
    # cuda:0 and CUDA name the same device class as cuda, torch.float32 the same dtype as float32
    client.post("/v1/traces", json=trace_dict(device="cuda"), headers=AUTH)
    assert client.get("/v1/plans/arch-1", params={**QUERY, "device": "cuda:0", "dtype": "torch.float32"}
                      ).status_code == 200


@pytest.mark.parametrize("params, detail", [
    ({**QUERY, "input_shape": "8,3,32"}, "model_hash: no linear plan (no budget) for arch-1 with input_shape 8,3,32"),
    ({**QUERY, "mode": "eval"}, "model_hash: no linear plan"),
    ({**QUERY, "budget": 1024}, "model_hash: no linear plan (budget 1024 bytes)"),
])
def test_unknown_keys_are_404_with_a_message(client: TestClient, params: dict, detail: str) -> None:
    client.post("/v1/traces", json=trace_dict(), headers=AUTH)
    response = client.get("/v1/plans/arch-1", params=params)
    assert response.status_code == 404 and response.json()["detail"].startswith(detail)
    assert client.get("/v1/plans/other-arch", params=QUERY).status_code == 404


@pytest.mark.parametrize("path, params, detail", [
    ("/v1/plans/arch-1", {**QUERY, "input_shape": "a,b"}, "input_shape: String should match pattern"),
    ("/v1/plans/arch-1", {**QUERY, "input_shape": "0,3"}, "input_shape: every dimension"),
    ("/v1/plans/arch-1", {**QUERY, "input_shape": "1048576,1048576,1048576"}, "input_shape: "),
    ("/v1/plans/arch-1", {**QUERY, "algorithm": "magic"}, "algorithm: Input should be"),
    ("/v1/plans/arch-1", {**QUERY, "budget": 0}, "budget: Input should be greater than or equal to 1"),
    ("/v1/plans/arch-1", {**QUERY, "dtype": "float 32"}, "dtype: String should match pattern"),
    ("/v1/plans/arch-1", {"dtype": "float32", "device": "cpu"}, "input_shape: Field required"),
    ("/v1/plans/bad%20hash", QUERY, "model_hash: String should match pattern"),
    ("/v1/plans", {"limit": 0}, "limit: Input should be greater than or equal to 1"),
    ("/v1/plans", {"offset": -1}, "offset: "),
    ("/v1/plans", {"offset": 10**30}, "offset: "),
])
def test_malformed_queries_are_422_naming_the_field(client: TestClient, path: str, params: dict,
                                                    detail: str) -> None:
    response = client.get(path, params=params)
    assert response.status_code == 422, response.text
    assert response.json()["detail"].startswith(detail)


SIGNATURE = "input_ids: int64[8, 3]; attention_mask: int64[8, 3]; labels: int64[8, 3]; use_cache=False"


def test_the_call_signature_is_part_of_the_key_read_from_the_query(client: TestClient) -> None:
    """A model called with several inputs and with one tensor of the same shape has a plan for each; the
    signature, with its ``;``, ``:``, ``[``, ``,`` and spaces, arrives whole however the query is encoded."""
    one = client.post("/v1/traces", json=trace_dict(), headers=AUTH).json()
    several = client.post("/v1/traces", json=trace_dict(inputs=SIGNATURE, scale=2), headers=AUTH).json()
    assert (one["key"]["inputs"], several["key"]["inputs"]) == ("", SIGNATURE)
    plain = client.get("/v1/plans/arch-1", params=QUERY)
    assert plain.status_code == 200 and plain.json()["key"]["inputs"] == ""
    assert plain.json()["trace"]["trace_id"] == one["trace_id"]
    assert client.get("/v1/plans/arch-1", params={**QUERY, "inputs": ""}).json() == plain.json()
    encoded = client.get("/v1/plans/arch-1", params={**QUERY, "inputs": SIGNATURE})
    assert encoded.status_code == 200, encoded.text
    assert encoded.json()["key"]["inputs"] == SIGNATURE and encoded.json()["trace"]["trace_id"] == several["trace_id"]
    # As a hand-written URL: ';' and ':' unescaped, spaces as %20 in one place and '+' in another.
    raw = ("/v1/plans/arch-1?input_shape=8,3,32,32&dtype=float32&device=cpu&inputs="
           + SIGNATURE.replace(" ", "%20", 3).replace(" ", "+").replace("[", "%5B").replace("]", "%5D"))
    assert client.get(raw).json() == encoded.json()
    for path in ("/v1/plans/arch-1/frontier", "/v1/plans/arch-1/timeline"):
        assert client.get(path, params={**QUERY, "inputs": "x: int64[8, 3]"}).status_code == 404
    missing = client.get("/v1/plans/arch-1", params={**QUERY, "inputs": "input_ids: int64[8, 3]"})
    assert missing.status_code == 404
    assert "inputs input_ids: int64[8, 3], dtype float32" in missing.json()["detail"]


@pytest.mark.parametrize("inputs, detail", [
    ("x: int64[2]\t", "inputs: String should match pattern"),
    ("x: int64[2]\n", "inputs: String should match pattern"),
    ("\u00e9: int64[2]", "inputs: String should match pattern"),
    ("x" * 2001, "inputs: String should have at most 2000 characters"),
])
def test_a_malformed_call_signature_is_422_naming_the_field(client: TestClient, inputs: str, detail: str) -> None:
    response = client.get("/v1/plans/arch-1", params={**QUERY, "inputs": inputs})
    assert response.status_code == 422, response.text
    assert response.json()["detail"].startswith(detail)
    rejected = client.post("/v1/traces", json=trace_dict(inputs=inputs), headers=AUTH)
    assert rejected.status_code == 422 and rejected.json()["detail"].startswith("inputs: ")


def test_list_plans_pages(client: TestClient) -> None:
    client.post("/v1/traces", json=trace_dict(), headers=AUTH)
    client.post("/v1/traces", json=trace_dict(model_hash="arch-2", model="other"), headers=AUTH)
    everything = client.get("/v1/plans", params={"limit": 200}).json()
    assert everything["count"] == len(everything["data"]) == 2 * len(PLANNERS)
    first = client.get("/v1/plans", params={"limit": 5}).json()
    second = client.get("/v1/plans", params={"limit": 5, "offset": 5}).json()
    assert first["count"] == 2 * len(PLANNERS) and len(first["data"]) == len(second["data"]) == 5
    assert {p["plan_id"] for p in first["data"]}.isdisjoint(p["plan_id"] for p in second["data"])
    only = client.get("/v1/plans", params={"model": "other", "algorithm": "cubic"}).json()
    assert only["count"] == 1 and only["data"][0]["key"]["model_hash"] == "arch-2"


def test_measurements_are_served_with_the_plan(client: TestClient) -> None:
    client.post("/v1/traces", json=trace_dict(), headers=AUTH)
    response = client.post("/v1/measurements", json=MEASURED, headers=AUTH)
    assert response.status_code == 201, response.text
    measured = client.get("/v1/plans/arch-1", params=QUERY).json()["measurements"]
    assert [(m["measured_peak_bytes"], m["grad_check_passed"]) for m in measured] == [(123456, True)]
    missing = client.post("/v1/measurements", json={**MEASURED, "algorithm": "linear", "budget_bytes": 5},
                          headers=AUTH)
    assert missing.status_code == 404 and missing.json()["detail"].startswith("key: no linear plan")
    unknown_field = client.post("/v1/measurements", json={**MEASURED, "peak": 1}, headers=AUTH)
    assert unknown_field.status_code == 422 and unknown_field.json()["detail"].startswith("peak: ")
    assert client.post("/v1/measurements", json=MEASURED).status_code == 401


def test_cache_miss_then_hit_then_invalidated_by_writes(cached_client: TestClient, redis_prefix: str) -> None:
    client = cached_client
    client.post("/v1/traces", json=trace_dict(), headers=AUTH)
    first = client.get("/v1/plans/arch-1", params=QUERY)
    second = client.get("/v1/plans/arch-1", params=QUERY)
    assert (first.headers["x-remat-cache"], second.headers["x-remat-cache"]) == ("miss", "hit")
    assert first.json() == second.json()

    client.post("/v1/measurements", json=MEASURED, headers=AUTH)  # invalidates this plan's entry
    after_measure = client.get("/v1/plans/arch-1", params=QUERY)
    assert after_measure.headers["x-remat-cache"] == "miss" and len(after_measure.json()["measurements"]) == 1

    client.post("/v1/traces", json=trace_dict(scale=7), headers=AUTH)  # re-profile of the same key
    after_profile = client.get("/v1/plans/arch-1", params=QUERY)
    assert after_profile.headers["x-remat-cache"] == "miss"
    assert after_profile.json()["trace"]["trace_id"] != first.json()["trace"]["trace_id"]
    assert client.get("/v1/plans/arch-1", params=QUERY).headers["x-remat-cache"] == "hit"


def test_a_call_signature_has_its_own_cache_entry(cached_client: TestClient) -> None:
    client = cached_client
    client.post("/v1/traces", json=trace_dict(), headers=AUTH)
    client.post("/v1/traces", json=trace_dict(inputs=SIGNATURE, scale=2), headers=AUTH)
    several = {**QUERY, "inputs": SIGNATURE}
    assert client.get("/v1/plans/arch-1", params=QUERY).headers["x-remat-cache"] == "miss"
    first = client.get("/v1/plans/arch-1", params=several)
    assert first.headers["x-remat-cache"] == "miss" and first.json()["key"]["inputs"] == SIGNATURE
    second = client.get("/v1/plans/arch-1", params=several)
    assert second.headers["x-remat-cache"] == "hit" and second.json() == first.json()
    assert client.get("/v1/plans/arch-1", params=QUERY).json()["key"]["inputs"] == ""
    client.post("/v1/traces", json=trace_dict(inputs=SIGNATURE, scale=7), headers=AUTH)  # re-profile of that call
    assert client.get("/v1/plans/arch-1", params=several).headers["x-remat-cache"] == "miss"
    assert client.get("/v1/plans/arch-1", params=QUERY).headers["x-remat-cache"] == "hit"


def test_redis_down_reads_fall_back_to_the_database(make_client: Callable[..., TestClient]) -> None:
    client = make_client(redis_url=closed_port_url())
    assert client.post("/v1/traces", json=trace_dict(), headers=AUTH).status_code == 201
    for _ in range(3):
        response = client.get("/v1/plans/arch-1", params=QUERY)
        assert response.status_code == 200 and response.headers["x-remat-cache"] == "miss"
    health = client.get("/healthz")
    assert health.status_code == 200
    assert health.json()["status"] == "degraded" and health.json()["cache"]["ok"] is False


def test_cached_values_are_json(cached_client: TestClient, redis_prefix: str) -> None:
    cached_client.post("/v1/traces", json=trace_dict(), headers=AUTH)
    cached_client.get("/v1/plans/arch-1", params=QUERY)
    client = redis.Redis.from_url(REDIS_URL)
    try:
        (name,) = [k for k in client.scan_iter(match=f"{redis_prefix}plan:*") if b'"arch-1"' in k][:1]
        assert client.get(name).startswith(b'{"plan_id":')
    finally:
        client.close()


def test_a_measured_timeline_is_served_apart_from_the_plan(client: TestClient) -> None:
    client.post("/v1/traces", json=trace_dict(), headers=AUTH)
    plain = client.get("/v1/plans/arch-1/timeline", params=QUERY)
    assert plain.status_code == 404 and plain.json()["detail"].startswith("algorithm: the linear plan's")
    timeline = {"ops": 10, "backward_op": 4, "op_index": [0, 5], "bytes": [100, 123456]}
    posted = client.post("/v1/measurements", json={**MEASURED, "extra": {"timeline": timeline, "note": "x"}},
                         headers=AUTH)
    assert posted.status_code == 201, posted.text
    response = client.get("/v1/plans/arch-1/timeline", params=QUERY)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["timeline"] == {**timeline, "sample": "aten op"}, "an old timeline is served as per aten op"
    assert body["measured_peak_bytes"] == 123456
    assert body["algorithm"] == "linear" and body["key"]["model_hash"] == "arch-1"
    assert body["predicted_peak_bytes"] > 0
    served = client.get("/v1/plans/arch-1", params=QUERY).json()["measurements"][0]["extra"]
    assert served == {"note": "x"}, "a plan fetch leaves the timeline out"
    missing = client.get("/v1/plans/arch-2/timeline", params=QUERY)
    assert missing.status_code == 404 and missing.json()["detail"].startswith("model_hash: no linear plan")


def test_a_budget_is_answered_from_the_stored_frontier(client: TestClient) -> None:
    from remat.client.planning.planners.budget import pareto_frontier
    from remat.client.trace import parse_trace

    body = trace_dict(num_stages=12)
    stored = client.post("/v1/traces", json=body, headers=AUTH).json()
    expected = pareto_frontier(parse_trace(body))
    assert [(p["checkpoints"], p["predicted_peak_bytes"]) for p in stored["frontier"]] == \
        [(list(p.checkpoints), p.peak_bytes) for p in expected]
    frontier = client.get("/v1/plans/arch-1/frontier", params=QUERY)
    assert frontier.status_code == 200
    points = frontier.json()["points"]
    assert [p["plan"]["budget_bytes"] for p in points] == [p.peak_bytes for p in expected]
    for point in expected:  # a budget at a point's peak, and just below the next one's, gets that point
        above = next((q.peak_bytes for q in expected if q.peak_bytes > point.peak_bytes), point.peak_bytes + 1)
        for budget in {point.peak_bytes, above - 1}:
            got = client.get("/v1/plans/arch-1", params={**QUERY, "algorithm": "budget", "budget": budget})
            assert got.status_code == 200, got.text
            assert got.json()["plan"]["checkpoints"] == list(point.checkpoints)
            assert got.json()["plan"]["budget_bytes"] == point.peak_bytes
    smallest = expected[0].peak_bytes
    below = client.get("/v1/plans/arch-1", params={**QUERY, "algorithm": "budget", "budget": smallest - 1})
    assert below.status_code == 422
    assert below.json()["detail"] == (f"budget: {smallest - 1} bytes is below the smallest feasible peak, "
                                      f"{smallest} bytes")
    missing = client.get("/v1/plans/arch-1", params={**QUERY, "algorithm": "budget"})
    assert missing.status_code == 422 and missing.json()["detail"].startswith("budget: required")


def test_a_nested_plan_below_the_chains_answers_the_budgets_they_cannot(client: TestClient) -> None:
    """Eight equal stages: nesting reaches 5000 bytes, no one-level plan below 6000 (NOTE [ budgets below the
    chains ] in remat.client.planning.plans). The upload stores nested's point; a budget between is answered
    with it, run nested, and one below it names the smallest peak."""
    body = trace_dict(num_stages=8)
    for stage in body["stages"]:
        stage.update(output_bytes=1000, saved_bytes=1000)
    stored = client.post("/v1/traces", json=body, headers=AUTH).json()
    nested = next(p for p in stored["plans"] if p["algorithm"] == "nested")
    linear = next(p for p in stored["plans"] if p["algorithm"] == "linear")
    assert nested["nested"] is True and nested["predicted_peak_bytes"] < linear["predicted_peak_bytes"]
    points = client.get("/v1/plans/arch-1/frontier", params=QUERY).json()["points"]
    assert points[0]["plan"]["nested"] is True
    assert points[0]["plan"]["budget_bytes"] == nested["predicted_peak_bytes"]
    assert points[1]["plan"]["budget_bytes"] == linear["predicted_peak_bytes"]
    between = (nested["predicted_peak_bytes"] + linear["predicted_peak_bytes"]) // 2
    got = client.get("/v1/plans/arch-1", params={**QUERY, "algorithm": "budget", "budget": between})
    assert got.status_code == 200, got.text
    assert got.json()["plan"]["checkpoints"] == nested["checkpoints"] and got.json()["plan"]["nested"] is True
    below = client.get("/v1/plans/arch-1", params={**QUERY, "algorithm": "budget",
                                                   "budget": nested["predicted_peak_bytes"] - 1})
    assert below.status_code == 422 and f"smallest feasible peak, {nested['predicted_peak_bytes']}" in \
        below.json()["detail"]


def test_no_frontier_is_a_404_naming_the_key(client: TestClient) -> None:
    response = client.get("/v1/plans/arch-9", params={**QUERY, "algorithm": "budget", "budget": 10**9})
    assert response.status_code == 404 and "no frontier is stored for arch-9" in response.json()["detail"]
    assert client.get("/v1/plans/arch-9/frontier", params=QUERY).status_code == 404


def test_a_large_trace_gets_its_frontier_from_a_plan_job(client: TestClient) -> None:
    body = client.post("/v1/traces", json=trace_dict(num_stages=600), headers=AUTH).json()
    assert body["frontier"] == []
    assert {d["algorithm"] for d in body["deferred"]} == {"cubic", "nested", "budget"}
    job = next(d for d in body["deferred"] if d["algorithm"] == "budget")
    assert client.get(f"/v1/jobs/{job['job_id']}").json()["request"]["algorithms"] == ["cubic", "nested", "budget"]
