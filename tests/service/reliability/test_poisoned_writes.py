"""Issue 31's findings on the service's door, each a test that failed on the main branch before the fix:
non-standard numbers committed by a write and then failing every read, anonymous bodies parsed before the token
check, number and nesting limits answered 400/500, and 405s without their ``Allow`` header."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.exc import StatementError

from remat.client.wire_json import WireJSONError
from remat.service import repository
from remat.service.db import Database
from tests.service.factories import AUTH, make_trace, trace_dict

JSON_AUTH = {**AUTH, "Content-Type": "application/json"}


def _key_query(key: dict[str, Any]) -> dict[str, str]:
    return {k: ",".join(map(str, v)) if isinstance(v, list) else str(v) for k, v in key.items()
            if k != "model_hash" and v not in (None, "")}


def _reads_answer(client: TestClient, key: dict[str, Any]) -> None:
    for path, params in ((f"/v1/plans/{key['model_hash']}", _key_query(key)),
                         (f"/v1/plans/{key['model_hash']}/frontier", _key_query(key)),
                         ("/v1/plans", {}), ("/v1/plans", {"model_hash": key["model_hash"]})):
        response = client.get(path, params=params)
        assert response.status_code in (200, 404), (path, response.status_code, response.text)


@pytest.mark.parametrize("poison", ["NaN", "Infinity", "-Infinity", "1e400", "9" * 5000, "[" * 40 + "]" * 40,
                                    '"\\ud800"'])
def test_a_measurement_that_json_loads_accepts_but_remat_cannot_keep_is_refused_and_reads_stay_up(
        client: TestClient, poison: str) -> None:
    key = client.post("/v1/traces", json=trace_dict(), headers=AUTH).json()["key"]
    body = (f'{{"key": {json.dumps(key)}, "algorithm": "linear", "measured_peak_bytes": 100, '
            f'"extra": {{"x": {poison}}}}}')
    response = client.post("/v1/measurements", content=body, headers=JSON_AUTH)
    assert response.status_code == 422, response.text
    assert response.json()["detail"].startswith("extra.x"), response.json()
    _reads_answer(client, key)
    stored = client.get(f"/v1/plans/{key['model_hash']}", params=_key_query(key)).json()
    assert stored["measurements"] == []


@pytest.mark.parametrize("route, body, field", [
    ("/v1/jobs", '{"model": "resnet18", "batch_size": ' + "1" * 5000 + ', "input_shape": [3, 8, 8]}', "batch_size"),
    ("/v1/jobs", '{"model": "resnet18", "batch_size": 1, "input_shape": ' + "[" * 1000 + "]" * 1000 + "}", "body"),
    ("/v1/zoo", '{"zoo": "torchvision", "batch_size": 1e400}', "batch_size"),
    ("/v1/traces", json.dumps(trace_dict()).replace('"forward_ms": 0.5', '"forward_ms": NaN'), "stages[0].forward_ms"),
    ("/v1/traces", json.dumps({**trace_dict(), "note": {"n": 10**30}}), "note.n"),
])
def test_numbers_and_nesting_past_the_limits_are_a_422_naming_the_field(client: TestClient, route: str, body: str,
                                                                      field: str) -> None:
    response = client.post(route, content=body, headers=JSON_AUTH)
    assert response.status_code == 422, response.text
    assert response.json()["detail"].startswith(f"{field}: "), response.json()


@pytest.mark.parametrize("route", ["/v1/traces", "/v1/measurements", "/v1/jobs", "/v1/zoo"])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer not-the-token"}])
def test_anonymous_bodies_are_refused_before_they_are_read(client: TestClient, route: str,
                                                           headers: dict[str, str]) -> None:
    # A body that would fail to parse: a server that parses before checking the token answers 422.
    response = client.post(route, content=b'{"not json', headers={**headers, "Content-Type": "application/json"})
    assert response.status_code == 401, response.text


def test_a_write_without_a_server_token_is_403_before_the_body(make_client) -> None:  # type: ignore[no-untyped-def]
    client = make_client(api_token=None)
    response = client.post("/v1/jobs", content=b"[[[", headers=JSON_AUTH)
    assert response.status_code == 403, response.text


@pytest.mark.parametrize("method, path, allow", [
    ("DELETE", "/v1/jobs", "GET, POST"),
    ("PUT", "/v1/plans/abc", "GET"),
    ("PATCH", "/v1/traces", "POST"),
    ("DELETE", "/v1/jobs/00000000-0000-4000-8000-000000000000", "GET"),
    ("POST", "/healthz", "GET"),
])
def test_every_405_lists_the_methods_of_its_path(client: TestClient, method: str, path: str, allow: str) -> None:
    response = client.request(method, path, headers=AUTH)
    assert response.status_code == 405
    assert response.headers["allow"] == allow
    assert response.json()["detail"].endswith(f"use {allow}")


def test_no_writer_can_store_json_that_a_read_cannot_serialize(db: Database) -> None:
    """Beyond the API (a worker, a script): the engine's JSON writer refuses, and the transaction holds nothing."""
    trace = make_trace()
    bad = {**trace.metadata, "calibration": {"ratio": float("nan")}}
    poisoned = type(trace)(input_bytes=trace.input_bytes, stages=trace.stages, metadata=bad, graph=trace.graph)
    with pytest.raises((StatementError, WireJSONError)) as info, db.write_session() as session:
        repository.store_trace(session=session, trace=poisoned)
    refusal = getattr(info.value, "orig", info.value)  # SQLite's driver has SQLAlchemy wrap it, psycopg does not
    assert isinstance(refusal, WireJSONError)
    assert str(refusal) == "calibration.ratio: nan is not a finite number"
    with db.read_session() as session:
        assert repository.list_plans(session=session, limit=10, offset=0)[1] == 0
