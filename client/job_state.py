"""The states of a service job: the one vocabulary the service stores and the CLI prints.

It lives in the client because both sides speak it and imports point from the service to the client, never
back; it imports nothing but the standard library, so the CLI and the HTTP client load no more than this.
Members are ``StrEnum``s: they compare equal to, serialise as and are stored as their plain spellings, so
a state read back from the database or from JSON (a plain ``str``) matches the member.

Public API::

    JobState.PENDING | QUEUED | RUNNING | SUCCEEDED | FAILED
    ACTIVE_JOB_STATES      # a worker may still run it: pending, queued, running
    FINISHED_JOB_STATES    # it ended and never changes again: succeeded, failed
    JOB_ID_PATTERN         # what a job's (and a zoo batch's) id looks like: a lowercase UUID
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["ACTIVE_JOB_STATES", "FINISHED_JOB_STATES", "JOB_ID_PATTERN", "JobState"]


class JobState(StrEnum):
    """Where a job is in its life; see service/jobs.py for the transitions."""

    PENDING = "pending"
    """Recorded, not yet handed to the broker (or the broker refused it; a reaper sends it again)."""
    QUEUED = "queued"
    """On the broker, or following another job that runs the same request."""
    RUNNING = "running"
    """A worker holds its lease (NOTE [job lease] in service/models.py)."""
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    """Ended with an error a person can act on (``error``), e.g. a broker that refused it or a lost worker."""


ACTIVE_JOB_STATES: tuple[JobState, ...] = (JobState.PENDING, JobState.QUEUED, JobState.RUNNING)
"""States of a job that has not ended: a request equal to one of these follows it instead of running again."""
FINISHED_JOB_STATES: tuple[JobState, ...] = (JobState.SUCCEEDED, JobState.FAILED)
"""States a job never leaves."""
JOB_ID_PATTERN = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
"""A job's id as the service makes it (a UUID, lowercase): what ``status JOB`` accepts and what the client
takes from the service's answers (so that an id it prints is one ``status`` accepts)."""
