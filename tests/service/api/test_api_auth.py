"""Bearer tokens: writes need the write token and are refused when none is configured; reads are open
unless the server says otherwise."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient

from tests.service.factories import AUTH, TOKEN, trace_dict


def test_writes_are_refused_when_no_token_is_configured(make_client: Callable[..., TestClient]) -> None:
    client = make_client(api_token=None)
    for path, body in (("/v1/traces", trace_dict()), ("/v1/jobs", {"model": "resnet18", "batch_size": 1,
                                                                   "input_shape": [3, 8, 8]})):
        response = client.post(path, json=body, headers=AUTH)
        assert response.status_code == 403
        assert "no REMAT_API_TOKEN configured" in response.json()["detail"]


@pytest.mark.parametrize("headers, message", [
    ({}, "missing bearer token"),
    ({"Authorization": "Bearer wrong-token"}, "not valid for writes"),
    ({"Authorization": f"Basic {TOKEN}"}, "missing bearer token"),
    ({"Authorization": f"Bearer {TOKEN}x"}, "not valid for writes"),
    ({"Authorization": "Bearer t\u00f6ken".encode()}, "not valid for writes"),  # non-ASCII bytes
])
def test_writes_need_the_write_token(client: TestClient, headers: dict[str, str | bytes], message: str) -> None:
    response = client.post("/v1/traces", json=trace_dict(), headers=headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert message in response.json()["detail"]


def test_the_write_token_is_accepted(client: TestClient) -> None:
    assert client.post("/v1/traces", json=trace_dict(), headers=AUTH).status_code == 201


def test_reads_are_open_by_default(client: TestClient) -> None:
    assert client.get("/v1/plans").status_code == 200
    assert client.get("/healthz").status_code == 200


def test_reads_can_require_a_token(make_client: Callable[..., TestClient]) -> None:
    client = make_client(read_token_required=True, read_token="reader")
    assert client.get("/v1/plans").status_code == 401
    assert client.get("/v1/plans", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.get("/v1/plans", headers={"Authorization": "Bearer reader"}).status_code == 200
    assert client.get("/v1/plans", headers=AUTH).status_code == 200  # the write token reads too
    assert client.get("/v1/jobs", headers={"Authorization": "Bearer reader"}).status_code == 200
    # the read token does not write
    assert client.post("/v1/traces", json=trace_dict(), headers={"Authorization": "Bearer reader"}).status_code == 401
