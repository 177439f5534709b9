"""Step times you can trust: what re-running a stage costs, and the spread of every measured step.

- ``trace_stages.recompute_ms``: what re-running the stage under a checkpoint adds to a step, measured in real
  steps by the profiler (``remat.client.trace.Stage.recompute_ms``);
- ``measurements.step_spread_ms`` and ``baseline_step_spread_ms``: the median of a step's timed rounds above
  their least (``remat.client.measurement.Measurement.step_spread_ms``).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-26
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("trace_stages") as batch:
        batch.add_column(sa.Column("recompute_ms", sa.Float(), nullable=True))
    with op.batch_alter_table("measurements") as batch:
        batch.add_column(sa.Column("step_spread_ms", sa.Float(), nullable=True))
        batch.add_column(sa.Column("baseline_step_spread_ms", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("measurements") as batch:
        batch.drop_column("baseline_step_spread_ms")
        batch.drop_column("step_spread_ms")
    with op.batch_alter_table("trace_stages") as batch:
        batch.drop_column("recompute_ms")
