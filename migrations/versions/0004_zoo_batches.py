"""Zoo batches: one row per ``POST /v1/zoo`` and one per model, pointing at the job that runs it.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "zoo_batches",
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("zoo", sa.String(32), nullable=False),
        sa.Column("filter", sa.String(200), nullable=True),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_zoo_batches"),
    )
    op.create_table(
        "zoo_batch_jobs",
        sa.Column("batch_id", sa.String(36), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("job_id", sa.String(36), nullable=False),
        sa.ForeignKeyConstraint(["batch_id"], ["zoo_batches.id"], ondelete="CASCADE",
                                name="fk_zoo_batch_jobs_batch_id_zoo_batches"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE", name="fk_zoo_batch_jobs_job_id_jobs"),
        sa.PrimaryKeyConstraint("batch_id", "position", name="pk_zoo_batch_jobs"),
    )
    op.create_index("ix_zoo_batch_jobs_job_id", "zoo_batch_jobs", ["job_id"])


def downgrade() -> None:
    op.drop_index("ix_zoo_batch_jobs_job_id", table_name="zoo_batch_jobs")
    op.drop_table("zoo_batch_jobs")
    op.drop_table("zoo_batches")
