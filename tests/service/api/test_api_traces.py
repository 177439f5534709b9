"""POST /v1/traces: store, plan with every algorithm, idempotency, and the 4xx answers."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from remat.worker.planners import PLANNERS
from tests.service.factories import AUTH, TORCH, trace_dict


def test_store_and_plan_with_every_algorithm(client: TestClient) -> None:
    response = client.post("/v1/traces", json=trace_dict(), headers=AUTH)
    assert response.status_code == 201
    body = response.json()
    assert body["created"] is True
    assert body["key"] == {"model_hash": "arch-1", "input_shape": [8, 3, 32, 32], "dtype": "float32",
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
     b'"saved_bytes": 1}]}', 422, "stages[0].name: is not valid Unicode"),
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
