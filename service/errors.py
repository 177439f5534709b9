"""Exceptions of the plan service, below the client library's hierarchy.

Hierarchy::

    RematError
    ├── TraceFormatError (client)
    │   └── TraceRejectedError      a valid remat-trace/1 the database will not store (absurd sizes, NUL
    │                               characters); the message names the field like TraceFormatError's
    ├── PlanError (client) ─ InvalidKeyError (client)   a plan key field is malformed (also ValueError)
    └── SchemaOutdatedError         the database is not at the migration head and was not to be migrated

Only the API layer turns these into HTTP status codes; the repository and the store raise them as is.
"""

from __future__ import annotations

from remat.client.errors import InvalidKeyError, RematError, TraceFormatError

__all__ = ["InvalidKeyError", "SchemaOutdatedError", "TraceRejectedError"]


class TraceRejectedError(TraceFormatError):
    """A well-formed trace that exceeds what the plan database stores; the message names the field."""


class SchemaOutdatedError(RematError):
    """The database schema is behind (or ahead of) this code; the message says how to migrate."""
