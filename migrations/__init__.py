"""Alembic migrations of the plan database, installed as ``remat.migrations`` so they ship with the package.

Run them with ``remat-service migrate`` (or ``alembic upgrade head`` from the repository root); the embedded
store runs them itself on first use of a SQLite file (see remat.service.migrate).
"""
