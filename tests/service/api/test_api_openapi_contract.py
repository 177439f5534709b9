"""The published error contract: which statuses each route documents in /openapi.json.

Clients generate code from this document, so a status dropped from it, or renumbered, is an API change even
when the route still behaves. The table is written here by hand (not read from service/api/deps.py, whose
tables would change with it); what each status really does is tested route by route (test_api_auth.py, …).
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

READ = {"200", "401", "422", "503"}
READ_ONE = READ | {"404"}
WRITE = {"400", "401", "403", "413", "422", "503"}

CONTRACT = {
    ("get", "/healthz"): {"200", "503"},
    ("post", "/v1/jobs"): WRITE | {"202"},
    ("get", "/v1/jobs"): READ,
    ("get", "/v1/jobs/{job_id}"): READ_ONE,
    ("post", "/v1/measurements"): WRITE | {"201", "404"},
    ("get", "/v1/plans"): READ,
    ("get", "/v1/plans/{model_hash}"): READ_ONE,
    ("get", "/v1/plans/{model_hash}/frontier"): READ_ONE,
    ("get", "/v1/plans/{model_hash}/timeline"): READ_ONE,
    ("post", "/v1/traces"): WRITE | {"200", "201"},
    ("post", "/v1/zoo"): WRITE | {"202"},
    ("get", "/v1/zoo/{batch_id}"): READ_ONE,
}


@pytest.fixture(scope="module")
def openapi() -> dict:
    from remat.service.api.app import create_app
    from remat.service.config import ServiceSettings

    settings = ServiceSettings(database_url="sqlite://", redis_url=None, api_token="t" * 32)
    return create_app(settings).openapi()


def test_every_route_documents_exactly_its_statuses(openapi: dict) -> None:
    documented = {(method, path): set(op["responses"]) for path, ops in openapi["paths"].items()
                  for method, op in ops.items()}
    assert set(documented) == set(CONTRACT), "a route was added or removed: extend CONTRACT"
    for route, statuses in CONTRACT.items():
        assert documented[route] == statuses, route


def test_every_documented_error_has_the_error_body_and_a_description(openapi: dict) -> None:
    for path, ops in openapi["paths"].items():
        for method, op in ops.items():
            for status, response in op["responses"].items():
                if status.startswith(("4", "5")) and status != "422" and path != "/healthz":  # /healthz: its report
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/ErrorOut"}, (method, path, status)
                assert response["description"].strip(), (method, path, status)


def test_the_statuses_say_what_they_mean(openapi: dict) -> None:
    traces = openapi["paths"]["/v1/traces"]["post"]["responses"]
    assert "REMAT_MAX_BODY_BYTES" in traces["413"]["description"]
    assert "no API token" in traces["403"]["description"]
    assert "database" in traces["503"]["description"].lower()
    assert "bearer token" in openapi["paths"]["/v1/plans"]["get"]["responses"]["401"]["description"]


def test_the_contract_holds_on_a_running_app(client: TestClient) -> None:
    """The served document is the one checked above (no route registered only at start-up differs)."""
    served = client.get("/openapi.json").json()
    assert {(m, p) for p, ops in served["paths"].items() for m in ops} == set(CONTRACT)
