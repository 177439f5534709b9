"""Alembic migrations: up and down on both backends, models in step with them, safe first use."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from remat.service import migrate
from remat.service.db import Database
from remat.service.errors import SchemaOutdatedError
from remat.service.models import Base
from remat.service.store import PlanStore

TABLES = {"architectures", "traces", "trace_stages", "plans", "measurements", "jobs"}


@pytest.fixture(params=["sqlite", "postgresql"])
def fresh_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database that no migration has touched."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'fresh.sqlite'}"
    factory: Callable[[], str] = request.getfixturevalue("pg_database_factory")
    return factory()


def _tables(db: Database) -> set[str]:
    return set(inspect(db.engine).get_table_names()) - {"alembic_version"}


def test_head_constant_is_alembics_head() -> None:
    assert migrate.HEAD_REVISION == migrate.head_revision()


def test_upgrade_downgrade_upgrade(fresh_url: str) -> None:
    db = Database(fresh_url)
    try:
        assert migrate.current_revision(db) is None
        migrate.upgrade(db)
        assert migrate.current_revision(db) == migrate.head_revision()
        assert _tables(db) == TABLES
        migrate.downgrade(db, "base")
        assert migrate.current_revision(db) is None
        assert _tables(db) == set()
        migrate.upgrade(db)
        assert _tables(db) == TABLES
    finally:
        db.dispose()


def test_models_match_migrations(fresh_url: str) -> None:
    """The ORM classes and the migrations describe the same schema (autogenerate finds nothing to do)."""
    db = Database(fresh_url)
    try:
        migrate.upgrade(db)
        with db.engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
        assert diff == []
    finally:
        db.dispose()


def test_ensure_current_migrates_once(sqlite_url: str) -> None:
    db = Database(sqlite_url)
    try:
        assert migrate.ensure_current(db) is True
        assert migrate.ensure_current(db) is False
    finally:
        db.dispose()


def test_concurrent_first_use_of_a_sqlite_file(sqlite_url: str) -> None:
    """Several CLI processes opening a fresh file at once: one migrates, the others wait; none fails."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def open_store() -> None:
        try:
            barrier.wait()
            with PlanStore(sqlite_url) as store:
                assert store.get_job("00000000-0000-0000-0000-000000000000") is None
        except BaseException as exc:  # collected and asserted on below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=open_store) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    db = Database(sqlite_url)
    assert migrate.current_revision(db) == migrate.head_revision()
    db.dispose()


def test_store_does_not_migrate_postgres_by_itself(pg_database_factory: Callable[[], str]) -> None:
    url = pg_database_factory()
    with pytest.raises(SchemaOutdatedError, match=r"remat-service migrate"):
        PlanStore(url).open()
    with PlanStore(url, auto_migrate=True) as store:
        assert store.get_job("00000000-0000-0000-0000-000000000000") is None
