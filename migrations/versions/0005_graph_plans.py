"""Graph plans: a trace's op graph, a plan's recomputed op-graph vertices, and what a measurement ran.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # All nullable: every stored trace, plan and measurement so far is a chain one (NULL reads as "none").
    with op.batch_alter_table("traces") as batch:
        batch.add_column(sa.Column("graph", sa.JSON(), nullable=True))
    with op.batch_alter_table("plans") as batch:
        batch.add_column(sa.Column("dropped_vertices", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("num_vertices", sa.Integer(), nullable=True))
    with op.batch_alter_table("measurements") as batch:
        batch.add_column(sa.Column("dropped_vertices", sa.JSON(), nullable=True))


def downgrade() -> None:
    # Graph plans cannot be told apart from chain plans without their vertices: drop them with the columns.
    # (SQLite migrates with foreign keys off, so their measurements are deleted first, not by cascade.)
    op.execute("DELETE FROM measurements WHERE plan_id IN (SELECT id FROM plans WHERE dropped_vertices IS NOT NULL)")
    op.execute("DELETE FROM plans WHERE dropped_vertices IS NOT NULL")
    with op.batch_alter_table("measurements") as batch:
        batch.drop_column("dropped_vertices")
    with op.batch_alter_table("plans") as batch:
        batch.drop_column("num_vertices")
        batch.drop_column("dropped_vertices")
    with op.batch_alter_table("traces") as batch:
        batch.drop_column("graph")
