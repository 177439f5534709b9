"""Workers: leased, deduplicated jobs; plans keyed on torch major.minor; one measurement record.

- plans.torch_version (major.minor of the trace's torch, ``unknown`` when it did not say) joins the plan key
  and its unique constraint, so clusters with two torch releases keep a plan for each;
- jobs get what the Celery workers need: kind, request_key (equal requests share one run; a partial unique
  index lets one active leader exist per request), leader_id, queue, attempts, lease_owner,
  lease_expires_at, enqueued_at and the plan key once known (NOTE [job lease] in models.py);
- measurements follow remat.client.measurement: the two columns that always equalled measured_peak_bytes and
  baseline_measured_peak_bytes are dropped, the prediction, absolute and requested peaks are added;
- traces.batch_size, always the metadata's batch_size, is dropped (it stays in traces.metadata).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)
ACTIVE = "leader_id IS NULL AND state IN ('pending', 'queued', 'running')"
OLD_KEY = ["architecture_id", "input_shape", "dtype", "mode", "grads", "device_class", "algorithm", "budget_bytes"]
NEW_KEY = ["architecture_id", "input_shape", "dtype", "mode", "grads", "device_class", "torch_version",
           "algorithm", "budget_bytes"]


def _major_minor(version: str | None) -> str:
    """``2.15.0+cu132`` → ``2.15``; anything unreadable → ``unknown`` (frozen copy of the client's rule)."""
    parts = (version or "").split("+")[0].split(".")
    minor = "".join(ch for ch in parts[1] if ch.isdigit()) if len(parts) >= 2 else ""
    if len(parts) < 2 or not parts[0].isdigit() or not minor:
        return "unknown"
    return f"{int(parts[0])}.{int(minor)}"


def upgrade() -> None:
    conn = op.get_bind()
    with op.batch_alter_table("plans") as batch:
        batch.add_column(sa.Column("torch_version", sa.String(16), nullable=False, server_default="unknown"))
    rows = conn.execute(sa.text("SELECT plans.id, traces.torch_version FROM plans "
                                "JOIN traces ON plans.trace_id = traces.id")).all()
    for plan_id, version in rows:
        conn.execute(sa.text("UPDATE plans SET torch_version = :v WHERE id = :id"),
                     {"v": _major_minor(version), "id": plan_id})
    with op.batch_alter_table("plans") as batch:
        batch.drop_constraint("uq_plans_key", type_="unique")
        batch.create_unique_constraint("uq_plans_key", NEW_KEY)

    with op.batch_alter_table("measurements") as batch:
        for name in ("predicted_peak_bytes", "baseline_predicted_peak_bytes", "absolute_peak_bytes",
                     "requested_peak_bytes"):
            batch.add_column(sa.Column(name, sa.BigInteger(), nullable=True))
        batch.drop_column("activation_measured_bytes")
        batch.drop_column("baseline_activation_measured_bytes")

    with op.batch_alter_table("traces") as batch:
        batch.drop_column("batch_size")

    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("kind", sa.String(16), nullable=False, server_default="profile"))
        batch.add_column(sa.Column("request_key", sa.String(64), nullable=True))
        batch.add_column(sa.Column("leader_id", sa.String(36), nullable=True))
        batch.add_column(sa.Column("queue", sa.String(64), nullable=True))
        batch.add_column(sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("lease_owner", sa.String(200), nullable=True))
        batch.add_column(sa.Column("lease_expires_at", TS, nullable=True))
        batch.add_column(sa.Column("enqueued_at", TS, nullable=True))
        batch.add_column(sa.Column("plan_key", sa.JSON(), nullable=True))
    op.create_index("ix_jobs_request_key", "jobs", ["request_key"])
    op.create_index("uq_jobs_active_request", "jobs", ["request_key"], unique=True,
                    sqlite_where=sa.text(ACTIVE), postgresql_where=sa.text(ACTIVE))


def downgrade() -> None:
    conn = op.get_bind()
    op.drop_index("uq_jobs_active_request", table_name="jobs")
    op.drop_index("ix_jobs_request_key", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        for name in ("plan_key", "enqueued_at", "lease_expires_at", "lease_owner", "attempts", "queue", "leader_id",
                     "request_key", "kind"):
            batch.drop_column(name)

    with op.batch_alter_table("traces") as batch:
        batch.add_column(sa.Column("batch_size", sa.Integer(), nullable=True))
    traces = sa.table("traces", sa.column("id", sa.Integer()), sa.column("metadata", sa.JSON()),
                      sa.column("batch_size", sa.Integer()))
    for trace_id, meta in conn.execute(sa.select(traces.c.id, traces.c.metadata)).all():
        batch_size = (meta or {}).get("batch_size")
        if isinstance(batch_size, int) and not isinstance(batch_size, bool):
            conn.execute(traces.update().where(traces.c.id == trace_id).values(batch_size=batch_size))

    with op.batch_alter_table("measurements") as batch:
        batch.add_column(sa.Column("activation_measured_bytes", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("baseline_activation_measured_bytes", sa.BigInteger(), nullable=True))
    conn.execute(sa.text("UPDATE measurements SET activation_measured_bytes = measured_peak_bytes, "
                         "baseline_activation_measured_bytes = baseline_measured_peak_bytes"))
    with op.batch_alter_table("measurements") as batch:
        for name in ("requested_peak_bytes", "absolute_peak_bytes", "baseline_predicted_peak_bytes",
                     "predicted_peak_bytes"):
            batch.drop_column(name)

    # Plans for several torch versions of one key cannot all survive the old constraint: keep the newest.
    conn.execute(sa.text(
        "DELETE FROM plans WHERE id NOT IN (SELECT MAX(id) FROM plans GROUP BY architecture_id, input_shape, dtype, "
        "mode, grads, device_class, algorithm, budget_bytes)"))
    with op.batch_alter_table("plans") as batch:
        batch.drop_constraint("uq_plans_key", type_="unique")
        batch.create_unique_constraint("uq_plans_key", OLD_KEY)
        batch.drop_column("torch_version")
