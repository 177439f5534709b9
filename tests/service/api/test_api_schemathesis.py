"""Property-based run of the published OpenAPI schema against the app, in-process (ASGI).

Hypothesis generates valid and invalid requests for every operation; schemathesis checks that none gets a
5xx, that every response matches its declared schema, status code and content type, and that requests the
schema calls invalid are refused. ``positive_data_acceptance`` is left out on purpose: some limits span
several fields (elements in batch_size x input_shape, the 2^40 cap on that product) and cannot be written
in JSON Schema, so a schema-valid request may rightly get a 422.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from remat.service.api.app import create_app
from remat.service.config import ServiceSettings
from tests.service.factories import AUTH, REDIS_URL, TOKEN, closed_port_url, trace_dict

MAX_EXAMPLES = 40


def _settings(database_url: str, **overrides: object) -> ServiceSettings:
    values: dict[str, object] = {"database_url": database_url, "redis_url": None, "broker_url": closed_port_url(),
                                 "broker_timeout_s": 1.0, "api_token": TOKEN, "auto_migrate": False}
    return ServiceSettings(**{**values, **overrides})


# The schema is read from an app that never touches its (in-memory) database; requests go to the test's
# app below. Loading it at import time rather than from a fixture keeps it clear of
# schemathesis.pytest.from_fixture, which does not run under pytest 9.2 (Function has no _nodeid).
schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(_settings("sqlite://")))


@pytest.fixture
def api_client(tmp_path: Path, redis_prefix: str) -> Iterator[TestClient]:
    """The app on a SQLite file (the backends are covered elsewhere), with the Redis cache and a dead broker."""
    settings = _settings(f"sqlite:///{tmp_path / 'remat.sqlite'}", redis_url=REDIS_URL, cache_prefix=redis_prefix,
                         auto_migrate=True)
    with TestClient(create_app(settings)) as client:
        client.post("/v1/traces", json=trace_dict(), headers=AUTH)  # something for the reads to find
        yield client


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_openapi_schema_holds(case: schemathesis.Case, api_client: TestClient) -> None:
    case.call_and_validate(app=api_client.app, headers=AUTH, excluded_checks=[positive_data_acceptance])
