"""Indexes for reading pages of the newest rows (the web pages, ``GET /v1/jobs``) without scanning a table.

- ``ix_plans_listing`` (algorithm, budget_bytes, updated_at): the architectures page lists one row per plan key,
  its ``none`` plan, newest first; without it every page read every plan row, frontier points included;
- ``ix_jobs_created_at``, ``ix_zoo_batches_created_at``: jobs and zoo batches are listed newest first.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_plans_listing", "plans", ["algorithm", "budget_bytes", "updated_at"])
    op.create_index("ix_jobs_created_at", "jobs", ["created_at"])
    op.create_index("ix_zoo_batches_created_at", "zoo_batches", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_zoo_batches_created_at", table_name="zoo_batches")
    op.drop_index("ix_jobs_created_at", table_name="jobs")
    op.drop_index("ix_plans_listing", table_name="plans")
