"""Trace stages: the cost-model fields found calibrating on a GPU.

saves_nothing (frameless checkpointed segments), cast_bytes and cast_unsaved_bytes (autocast's cast cache),
forward_peak_dropped_bytes (a checkpointed stage's first forward) and recomputed_backward_peak_bytes (the
backward of a recomputed stage); docs/cost-model.md. Existing rows get the values a trace without them means.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BYTE_COLUMNS = ("forward_peak_dropped_bytes", "recomputed_backward_peak_bytes", "cast_bytes", "cast_unsaved_bytes")


def upgrade() -> None:
    with op.batch_alter_table("trace_stages") as batch:
        for name in BYTE_COLUMNS:
            batch.add_column(sa.Column(name, sa.BigInteger(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("saves_nothing", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("trace_stages") as batch:
        batch.drop_column("saves_nothing")
        for name in reversed(BYTE_COLUMNS):
            batch.drop_column(name)
