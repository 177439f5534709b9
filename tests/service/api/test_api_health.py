"""GET /healthz reports the database and the cache; a dead database is 503, never 500."""

from __future__ import annotations

from collections.abc import Callable

from fastapi.testclient import TestClient

from tests.service.factories import AUTH, REDIS_URL, closed_port_url, trace_dict


def test_all_reachable(make_client: Callable[..., TestClient], redis_prefix: str) -> None:
    body = make_client(redis_url=REDIS_URL, broker_url=REDIS_URL, cache_prefix=redis_prefix).get("/healthz").json()
    assert body == {"status": "ok", "database": {"ok": True, "detail": None}, "cache": {"ok": True, "detail": None},
                    "broker": {"ok": True, "detail": None}}


def test_broker_down_is_degraded_not_down(make_client: Callable[..., TestClient], redis_prefix: str) -> None:
    response = make_client(redis_url=REDIS_URL, cache_prefix=redis_prefix, broker_url=closed_port_url()).get("/healthz")
    body = response.json()
    assert response.status_code == 200 and body["status"] == "degraded"
    assert body["broker"]["ok"] is False and "Connection refused" in body["broker"]["detail"]
    assert body["database"]["ok"] and body["cache"]["ok"]


def test_no_cache_configured(make_client: Callable[..., TestClient]) -> None:
    body = make_client(broker_url=REDIS_URL).get("/healthz").json()
    assert body["status"] == "ok" and body["cache"] == {"ok": True, "detail": "disabled"}


def test_database_down_is_503_everywhere(make_client: Callable[..., TestClient]) -> None:
    client = make_client(database_url=closed_port_url("postgresql+psycopg").removesuffix("/0") + "/remat")
    health = client.get("/healthz")
    assert health.status_code == 503 and health.json()["status"] == "unavailable"
    assert health.json()["database"]["ok"] is False
    for response in (client.get("/v1/plans"),
                     client.get("/v1/plans/arch-1", params={"input_shape": "1", "dtype": "float32", "device": "cpu"}),
                     client.post("/v1/traces", json=trace_dict(), headers=AUTH),
                     client.post("/v1/jobs", json={"model": "resnet18", "batch_size": 1, "input_shape": [3, 8, 8]},
                                 headers=AUTH)):
        assert response.status_code == 503, response.text
        assert response.json()["detail"].startswith("database: unavailable")
