"""Engine and session factories for SQLite (embedded) and PostgreSQL (cluster).

NOTE [SQLite write transactions]: SQLite allows one writer at a time. A transaction that reads first and
writes later gets ``SQLITE_BUSY`` immediately, without waiting on the busy timeout, when another connection
committed in between (its snapshot is stale). Write sessions therefore open with ``BEGIN IMMEDIATE``, which
takes the write lock up front and waits politely; read sessions use a plain ``BEGIN`` so that readers never
queue behind each other (WAL mode lets them run beside the writer). pysqlite's own implicit transactions are
switched off so that these BEGINs are the ones that run.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session
from sqlalchemy.pool import StaticPool

from remat.client import wire_json

SQLITE_BUSY_TIMEOUT_S = 30.0
_WRITE_OPTION = "remat_write"


def _is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def _use_wal(cursor: Any) -> None:
    """Put the database file in WAL mode, waiting for other connections doing the same.

    WAL mode is a property of the file, set once. Changing it needs the exclusive lock, and SQLite answers
    ``database is locked`` at once, without its busy handler, while another connection holds it: several
    CLI processes opening a fresh file together each tried the switch and some failed. So the mode is read
    first (no lock needed) and the switch is retried until the busy timeout, re-reading the mode in between,
    since the connection holding the lock is usually making the very same switch.
    """
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_S
    delay_s = 0.005
    while cursor.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(delay_s)
            delay_s = min(delay_s * 2, 0.2)


def json_for_storage(value: Any) -> str:
    """Every JSON column's writer: standard JSON only (``wire_json``'s rules), so that no row holds what a later
    read cannot serialize. The API refuses such values at the door with a 422; this refuses them from any
    other writer (a worker, a script) before the transaction commits, instead of poisoning every read."""
    wire_json.check(value, where="stored JSON")
    return json.dumps(value, allow_nan=False)


def _sqlite_engine(url: str) -> Engine:
    parsed = make_url(url)
    database = parsed.database or ""
    in_memory = database in ("", ":memory:")
    if not in_memory:
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {"connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False}}
    if in_memory:
        kwargs["poolclass"] = StaticPool  # one shared connection, or every session would see an empty DB
    engine = create_engine(url, json_serializer=json_for_storage, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # see NOTE [SQLite write transactions]
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        if not in_memory:
            _use_wal(cursor)
            cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        write = conn.get_execution_options().get(_WRITE_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


def make_engine(url: str) -> Engine:
    """Create an engine for ``url`` with the settings this service relies on (see module NOTE)."""
    if _is_sqlite(url):
        return _sqlite_engine(url)
    # pre_ping: a PostgreSQL restart must cost one reconnect, not a 500 per pooled connection.
    return create_engine(url, pool_pre_ping=True, connect_args={"connect_timeout": 5},
                         json_serializer=json_for_storage)


class Database:
    """An engine plus the two kinds of transactional sessions the repository is used with."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = make_engine(url)
        self._write_bind = self.engine.execution_options(**{_WRITE_OPTION: True})

    @property
    def is_sqlite(self) -> bool:
        return self.engine.dialect.name == "sqlite"

    @contextmanager
    def read_session(self) -> Iterator[Session]:
        """A session in one transaction that only reads (a plain ``BEGIN`` on SQLite)."""
        with Session(self.engine, expire_on_commit=False) as session, session.begin():
            yield session

    @contextmanager
    def write_session(self) -> Iterator[Session]:
        """A session in one transaction, committed when the block exits normally, rolled back otherwise."""
        with Session(self._write_bind, expire_on_commit=False) as session, session.begin():
            yield session

    @contextmanager
    def write_connection(self) -> Iterator[Any]:
        """A connection in a write transaction (migrations take the SQLite write lock through it)."""
        with self._write_bind.connect() as conn, conn.begin():
            yield conn

    @contextmanager
    def migration_connection(self) -> Iterator[Any]:
        """``write_connection`` for Alembic: on SQLite with foreign-key actions off for the migration.

        SQLite alters a table by copying it and dropping the original; with foreign keys on, that DROP deletes
        every row referencing the table through ``ON DELETE CASCADE`` (a plans rebuild emptied measurements).
        The pragma only takes effect outside a transaction, so it is set on the raw connection first, and the
        schema is checked with ``foreign_key_check`` before the migration commits.
        """
        with self._write_bind.connect() as conn:
            raw = conn.connection.dbapi_connection if self.is_sqlite else None
            if raw is not None:
                raw.execute("PRAGMA foreign_keys=OFF")
            try:
                with conn.begin():
                    yield conn
                    if raw is not None:
                        broken = conn.exec_driver_sql("PRAGMA foreign_key_check").all()
                        if broken:
                            raise RuntimeError(f"migration left rows with dangling foreign keys: {broken[:5]}")
            finally:
                if raw is not None:
                    raw.execute("PRAGMA foreign_keys=ON")

    def dispose(self) -> None:
        self.engine.dispose()

    def forget_after_fork(self) -> None:
        """In a forked child: drop the inherited pool without closing its connections, which the parent
        still uses (closing them from the child would end the parent's sessions)."""
        self.engine.dispose(close=False)
