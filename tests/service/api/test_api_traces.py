"""POST /v1/traces: store, plan with every algorithm, idempotency, and the 4xx answers."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from remat.client.planning.planners import PLANNERS
from tests.service.factories import AUTH, TORCH, trace_dict


def test_store_and_plan_with_every_algorithm(client: TestClient) -> None:
    response = client.post("/v1/traces", json=trace_dict(), headers=AUTH)
    assert response.status_code == 201
    body = response.json()
    assert body["created"] is True
    assert body["key"] == {"model_hash": "arch-1", "input_shape": [8, 3, 32, 32], "inputs": "", "dtype": "float32",
                           "device": "cpu", "mode": "train", "grads": "none", "torch_version": TORCH}
    assert [p["algorithm"] for p in body["plans"]] == list(PLANNERS)
    again = client.post("/v1/traces", json=trace_dict(), headers=AUTH)
    assert again.status_code == 200 and again.json()["created"] is False
    assert again.json()["trace_id"] == body["trace_id"]


@pytest.mark.parametrize("body, status, detail", [
    (b"{not json", 422, "trace: not valid JSON"),
    (b"[1, 2]", 422, "trace: must be a JSON object"),
    (b"[" * 100_000 + b"]" * 100_000, 422, "trace: "),
    (json.dumps({**trace_dict(), "format": "remat-trace/2"}).encode(), 422, "format: must be 'remat-trace/1'"),
    (json.dumps({**trace_dict(), "stages": []}).encode(), 422, "stages: must hold at least one stage"),
    (json.dumps({**trace_dict(), "stages": [{"name": "a", "output_bytes": -1, "saved_bytes": 0}]}).encode(),
     422, "stages[0].output_bytes: must be ≥ 0"),
    (json.dumps({**trace_dict(), "stages": [{"name": "a", "output_bytes": 2**50, "saved_bytes": 0}]}).encode(),
     422, "stages[0].output_bytes: more than"),
    (json.dumps({**trace_dict(), "input_shape": [2**31, 3]}).encode(), 422, "input_shape: every dimension"),
    (json.dumps({**trace_dict(), "input_shape": [1] * 9}).encode(), 422, "input_shape: at most 8 dimensions"),
    (json.dumps({**trace_dict(), "model_hash": "has space"}).encode(), 422, "model_hash: must be"),
    (json.dumps({**trace_dict(), "mode": "inference"}).encode(), 422, "mode: must be one of train, eval"),
    (json.dumps({**trace_dict(), "model": "a\u0000b"}).encode(), 422, "model: contains a NUL character"),
    (b'{"format": "remat-trace/1", "input_bytes": 1, "stages": [{"name": "\\ud800", "output_bytes": 1, '
     b'"saved_bytes": 1}]}', 422, "stages[0].name: not valid Unicode"),
    (b"\xff\xfe", 422, "trace: not valid JSON"),
])
def test_bad_traces_get_a_4xx_naming_the_field(client: TestClient, body: bytes, status: int, detail: str) -> None:
    response = client.post("/v1/traces", content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == status, response.text
    assert response.json()["detail"].startswith(detail)


def test_oversized_bodies_get_413(make_client) -> None:  # type: ignore[no-untyped-def]
    client = make_client(max_body_bytes=4096)
    big = json.dumps(trace_dict(num_stages=200)).encode()
    assert len(big) > 4096
    response = client.post("/v1/traces", content=big, headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["detail"].startswith("body: ")

    def chunks():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    response = client.post("/v1/traces", content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == 413
    jobs = client.post("/v1/jobs", content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
    assert jobs.status_code == 413


def test_a_trace_at_the_stage_limit_is_planned_one_past_it_is_refused(client: TestClient) -> None:
    from remat.service.config import ServiceSettings

    limit = ServiceSettings().max_stages
    at_limit = client.post("/v1/traces", json=trace_dict(num_stages=limit), headers=AUTH)
    assert at_limit.status_code == 201, at_limit.text
    body = at_limit.json()
    assert [p["algorithm"] for p in body["plans"]] == [a for a in PLANNERS if a not in ("cubic", "nested")]
    assert body["deferred"] == [] and [s["algorithm"] for s in body["skipped"]] == ["cubic", "nested", "budget"]
    reasons = {s["algorithm"]: s["reason"] for s in body["skipped"]}
    assert body["frontier"] == [] and "not computed above 2000" in reasons["budget"]
    assert "REMAT_MAX_CUBIC_STAGES" in reasons["cubic"] and "O(n^2): not run above 2000" in reasons["nested"]
    past = client.post("/v1/traces", json=trace_dict(num_stages=limit + 1), headers=AUTH)
    assert past.status_code == 422
    assert past.json()["detail"] == (f"stages: {limit + 1} stages, more than the {limit} this service plans "
                                     f"(REMAT_MAX_STAGES); merge stages, e.g. cut at block boundaries")


def test_cubic_runs_inline_while_fast_and_as_a_plan_job_beyond(client: TestClient) -> None:
    from remat.service.config import ServiceSettings

    settings = ServiceSettings()
    small = client.post("/v1/traces", json=trace_dict(num_stages=settings.inline_cubic_stages), headers=AUTH).json()
    assert "cubic" in [p["algorithm"] for p in small["plans"]] and small["deferred"] == small["skipped"] == []
    big = client.post("/v1/traces", json=trace_dict(num_stages=settings.inline_cubic_stages + 1, model_hash="arch-2"),
                      headers=AUTH).json()
    assert "cubic" not in [p["algorithm"] for p in big["plans"]] and big["skipped"] == []
    (deferred,) = big["deferred"]
    assert deferred["algorithm"] == "cubic"
    job = client.get(f"/v1/jobs/{deferred['job_id']}").json()
    assert job["kind"] == "plan" and job["queue"] == "plan"
    assert job["request"] == {"trace_id": big["trace_id"], "algorithms": ["cubic"]}
    again = client.post("/v1/traces", json=trace_dict(num_stages=settings.inline_cubic_stages + 1,
                                                       model_hash="arch-2"), headers=AUTH).json()
    assert client.get(f"/v1/jobs/{again['deferred'][0]['job_id']}").json()["leader_id"] == deferred["job_id"]
