"""Fixtures of the service tests: a database per backend (SQLite file, PostgreSQL), Redis, and app clients.

PostgreSQL: one uniquely named database per test session (``remat_test_<hex>``) migrated once, emptied
before each test that uses it, dropped at the end; migration tests get databases of their own. Redis: a
unique key prefix per session, deleted at the end, so parallel runs and other suites sharing the server
never see each other's keys. A missing PostgreSQL or Redis skips the tests that need it, with the reason,
except under ``CI=true`` where it fails them (tests/conftest.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from remat.service import migrate
from remat.service.api.app import create_app
from remat.service.config import ServiceSettings
from remat.service.db import Database
from remat.service.models import Base
from tests.conftest import require_service
from tests.service.factories import PG_ADMIN_URL, REDIS_URL, TOKEN, closed_port_url

# --- PostgreSQL -------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def pg_admin() -> Iterator[Any]:
    """An AUTOCOMMIT engine on the server's ``test`` database, for CREATE/DROP DATABASE."""
    engine = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except OperationalError as exc:
        engine.dispose()
        require_service("PostgreSQL", False, f"{PG_ADMIN_URL}: {str(exc).splitlines()[0]}")
    yield engine
    engine.dispose()


@pytest.fixture(scope="session")
def pg_database_factory(pg_admin: Any) -> Iterator[Callable[[], str]]:
    """Create fresh, empty PostgreSQL databases; all are dropped at the end of the session."""
    created: list[str] = []

    def create() -> str:
        name = f"remat_test_{uuid.uuid4().hex[:12]}"
        with pg_admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))  # name is generated above, not user input
        created.append(name)
        return make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)

    yield create
    with pg_admin.connect() as conn:
        for name in created:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(scope="session")
def pg_url(pg_database_factory: Callable[[], str]) -> str:
    """The session's migrated PostgreSQL database."""
    url = pg_database_factory()
    db = Database(url)
    migrate.upgrade(db)
    db.dispose()
    return url


def _empty(db: Database) -> None:
    with db.write_session() as session:
        for table in reversed(Base.metadata.sorted_tables):
            session.execute(table.delete())


# --- backends ---------------------------------------------------------------------------------------------

@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'remat.sqlite'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A migrated, empty database on each backend."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'remat.sqlite'}"
        db = Database(url)
        migrate.upgrade(db)
        db.dispose()
        yield url
        return
    url = request.getfixturevalue("pg_url")
    db = Database(url)
    _empty(db)
    db.dispose()
    yield url


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    database = Database(db_url)
    yield database
    database.dispose()


# --- Redis ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def redis_prefix() -> Iterator[str]:
    """A key prefix of this session's own on the shared Redis; its keys are deleted at the end."""
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=1, socket_connect_timeout=1)
    prefix = f"remat-test-{uuid.uuid4().hex[:12]}:"
    try:
        client.ping()
        reachable, detail = True, ""
    except redis.RedisError as exc:
        reachable, detail = False, f"{REDIS_URL}: {exc}"
    try:
        require_service("Redis", reachable, detail)
        yield prefix
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=1)
    yield client
    client.close()


# --- settings and app -------------------------------------------------------------------------------------

@pytest.fixture
def make_settings(db_url: str) -> Callable[..., ServiceSettings]:
    """Settings on the test database: no Redis, a broker nobody listens on, a write token."""

    def make(**overrides: Any) -> ServiceSettings:
        values: dict[str, Any] = {"database_url": db_url, "redis_url": None, "broker_url": closed_port_url(),
                                  "api_token": TOKEN, "broker_timeout_s": 1.0, "auto_migrate": False}
        values.update(overrides)
        return ServiceSettings(**values)

    return make


@pytest.fixture
def make_client(make_settings: Callable[..., ServiceSettings]) -> Iterator[Callable[..., TestClient]]:
    """Build in-process clients of apps with the given settings overrides; closed at the end."""
    clients: list[TestClient] = []

    def make(**overrides: Any) -> TestClient:
        client = TestClient(create_app(make_settings(**overrides)))
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def client(make_client: Callable[..., TestClient]) -> TestClient:
    return make_client()
