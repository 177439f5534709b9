"""Run the Alembic migrations from code: the service's start-up, the embedded store's first use, tests.

The scripts ship inside the package (``remat.migrations``), so this works from an installed wheel as well
as from a checkout; no ``alembic.ini`` is needed (the one at the repository root is for writing new
revisions by hand).

Migrations run on a connection in a *write* transaction (``BEGIN IMMEDIATE`` on SQLite, see NOTE [SQLite
write transactions] in db.py), and the revision is checked again under that lock: two CLI processes that
open a fresh SQLite file at the same moment migrate it once, and the second one waits and then finds it done.

Alembic is imported only when a migration has to run: the everyday check (is the database at
:data:`HEAD_REVISION`?) is one query, so opening the embedded store stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy import inspect, text

from remat.service.db import Database

if TYPE_CHECKING:
    from alembic.config import Config

SCRIPT_LOCATION = "remat.migrations:"
"""Where Alembic finds the revisions: the installed ``remat.migrations`` package, named as a resource. The
scripts are data the service runs; their code imports the service's models (to say what they migrate), so
importing them from here would point the dependency both ways."""

HEAD_REVISION = "0009"
"""The newest revision in migrations/versions; a test keeps it equal to Alembic's own head."""


def alembic_config(*, connection: Any = None) -> Config:
    """An Alembic config pointing at the packaged scripts, optionally bound to an open connection."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head_revision() -> str | None:
    """The head revision as Alembic reads it from the scripts."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def _revision(conn: Any) -> str | None:
    if not inspect(conn).has_table("alembic_version"):
        return None
    return conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one_or_none()


def current_revision(db: Database) -> str | None:
    """The revision the database is at; None for a database no migration has touched."""
    with db.engine.connect() as conn:
        return _revision(conn)


def upgrade(db: Database, revision: str = "head") -> None:
    from alembic import command

    with db.migration_connection() as conn:
        command.upgrade(alembic_config(connection=conn), revision)


def downgrade(db: Database, revision: str = "base") -> None:
    from alembic import command

    with db.migration_connection() as conn:
        command.downgrade(alembic_config(connection=conn), revision)


def ensure_current(db: Database) -> bool:
    """Upgrade to head if the database is behind; True when a migration ran.

    The cheap check runs without a lock; only a database that looks behind is locked and checked again.
    """
    if current_revision(db) == HEAD_REVISION:
        return False
    from alembic import command

    with db.migration_connection() as conn:
        if _revision(conn) == HEAD_REVISION:
            return False
        command.upgrade(alembic_config(connection=conn), "head")
    return True
