"""Alembic environment: runs migrations on a connection handed in by remat.service.migrate, or on the
database the service settings name (``alembic upgrade head`` from the repository root, ``REMAT_DATABASE_URL``).
"""

from __future__ import annotations

from typing import Any

from alembic import context

from remat.service.config import ServiceSettings
from remat.service.db import Database
from remat.service.models import Base

target_metadata = Base.metadata


def _run(connection: Any) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters tables by copying them
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    url = context.config.attributes.get("url") or ServiceSettings().database_url
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    db = Database(context.config.attributes.get("url") or ServiceSettings().database_url)
    try:
        with db.migration_connection() as conn:
            _run(conn)
    finally:
        db.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
