"""Calls of several inputs: the plan key's ``inputs`` (the training call's signature) on traces and plans.

- traces.inputs and plans.inputs hold ``PlanKey.inputs``: every input's name, dtype and shape and every constant
  the call passes (``input_ids: int64[2, 256]; use_cache=False``), "" for a call of one positional tensor, which
  is what every row stored so far describes;
- the column joins the plan key's unique constraint (``uq_plans_key``) and the traces' signature index, so a
  model called two ways keeps a plan for each;
- a trace stored before this revision that already recorded its signature in its metadata (a newer profiler
  against an older service) gets it as its key, and so do the plans computed from it.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MAX_INPUTS_CHARS = 2000
OLD_SIGNATURE = ["architecture_id", "input_shape", "dtype", "mode", "grads", "device_class"]
NEW_SIGNATURE = ["architecture_id", "input_shape", "inputs", "dtype", "mode", "grads", "device_class"]
OLD_KEY = ["architecture_id", "input_shape", "dtype", "mode", "grads", "device_class", "torch_version",
           "algorithm", "budget_bytes"]
NEW_KEY = ["architecture_id", "input_shape", "inputs", "dtype", "mode", "grads", "device_class", "torch_version",
           "algorithm", "budget_bytes"]


def _signature(value: object) -> str:
    """A trace's recorded ``inputs`` when the key accepts it, else "" (frozen copy of the client's rule:
    printable ASCII, at most MAX_INPUTS_CHARS characters)."""
    if not isinstance(value, str) or len(value) > MAX_INPUTS_CHARS:
        return ""
    return value if all(" " <= ch <= "~" for ch in value) else ""


def _inputs_column() -> sa.Column:
    return sa.Column("inputs", sa.String(MAX_INPUTS_CHARS), nullable=False, server_default="")


def upgrade() -> None:
    conn = op.get_bind()
    with op.batch_alter_table("traces") as batch:
        batch.add_column(_inputs_column())
    with op.batch_alter_table("plans") as batch:
        batch.add_column(_inputs_column())

    traces = sa.table("traces", sa.column("id", sa.Integer()), sa.column("metadata", sa.JSON()),
                      sa.column("inputs", sa.String()))
    recorded = []
    for trace_id, meta in conn.execute(sa.select(traces.c.id, traces.c.metadata)).all():
        value = _signature(meta.get("inputs")) if isinstance(meta, dict) else ""
        if value:
            recorded.append({"trace_id": trace_id, "value": value})
    if recorded:
        conn.execute(traces.update().where(traces.c.id == sa.bindparam("trace_id"))
                     .values(inputs=sa.bindparam("value")), recorded)
        # Adding a column to the key cannot make two plans collide: the constraint is rebuilt below.
        conn.execute(sa.text("UPDATE plans SET inputs = (SELECT traces.inputs FROM traces "
                             "WHERE traces.id = plans.trace_id) "
                             "WHERE trace_id IN (SELECT id FROM traces WHERE inputs <> '')"))

    op.drop_index("ix_traces_signature", table_name="traces")
    op.create_index("ix_traces_signature", "traces", NEW_SIGNATURE)
    with op.batch_alter_table("plans") as batch:
        batch.drop_constraint("uq_plans_key", type_="unique")
        batch.create_unique_constraint("uq_plans_key", NEW_KEY)


def downgrade() -> None:
    # The older schema cannot tell a call of several inputs from a single-tensor one: its plans (which would
    # collide with the single-tensor plans of the same shape) and its traces (which would be planned again under
    # the single-tensor key) go with the column. SQLite migrates with foreign keys off, so the rows that refer
    # to them are deleted first, not by cascade.
    several = "SELECT id FROM traces WHERE inputs <> ''"
    doomed_plans = f"inputs <> '' OR trace_id IN ({several})"
    op.execute(f"DELETE FROM measurements WHERE plan_id IN (SELECT id FROM plans WHERE {doomed_plans})")
    op.execute(f"DELETE FROM plans WHERE {doomed_plans}")
    op.execute(f"DELETE FROM trace_stages WHERE trace_id IN ({several})")
    op.execute("DELETE FROM traces WHERE inputs <> ''")
    with op.batch_alter_table("plans") as batch:
        batch.drop_constraint("uq_plans_key", type_="unique")
        batch.create_unique_constraint("uq_plans_key", OLD_KEY)
        batch.drop_column("inputs")
    op.drop_index("ix_traces_signature", table_name="traces")
    op.create_index("ix_traces_signature", "traces", OLD_SIGNATURE)
    with op.batch_alter_table("traces") as batch:
        batch.drop_column("inputs")
