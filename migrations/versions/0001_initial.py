"""Initial schema: architectures, traces and their stages, plans, measurements, jobs.

Revision ID: 0001
Revises:
Create Date: 2025-11-21
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "architectures",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("hash", sa.String(128), nullable=False),
        sa.Column("name", sa.String(200), nullable=True),
        sa.Column("graph_summary", sa.JSON(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_architectures"),
        sa.UniqueConstraint("hash", name="uq_architectures_hash"),
    )
    op.create_table(
        "traces",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("architecture_id", sa.Integer(), nullable=False),
        sa.Column("content_sha256", sa.String(64), nullable=False),
        sa.Column("input_shape", sa.String(200), nullable=False),
        sa.Column("dtype", sa.String(32), nullable=False),
        sa.Column("mode", sa.String(8), nullable=False),
        sa.Column("grads", sa.String(8), nullable=False),
        sa.Column("device_class", sa.String(32), nullable=False),
        sa.Column("device_name", sa.String(200), nullable=True),
        sa.Column("torch_version", sa.String(64), nullable=True),
        sa.Column("batch_size", sa.Integer(), nullable=True),
        sa.Column("input_bytes", sa.BigInteger(), nullable=False),
        sa.Column("num_stages", sa.Integer(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.ForeignKeyConstraint(["architecture_id"], ["architectures.id"], ondelete="CASCADE",
                                name="fk_traces_architecture_id_architectures"),
        sa.PrimaryKeyConstraint("id", name="pk_traces"),
        sa.UniqueConstraint("content_sha256", name="uq_traces_content_sha256"),
    )
    op.create_index("ix_traces_signature", "traces",
                    ["architecture_id", "input_shape", "dtype", "mode", "grads", "device_class"])
    op.create_table(
        "trace_stages",
        sa.Column("trace_id", sa.Integer(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("output_bytes", sa.BigInteger(), nullable=False),
        sa.Column("saved_bytes", sa.BigInteger(), nullable=False),
        sa.Column("forward_peak_bytes", sa.BigInteger(), nullable=False),
        sa.Column("recompute_peak_bytes", sa.BigInteger(), nullable=False),
        sa.Column("backward_peak_bytes", sa.BigInteger(), nullable=False),
        sa.Column("param_grad_bytes", sa.BigInteger(), nullable=False),
        sa.Column("saves_input", sa.Boolean(), nullable=False),
        sa.Column("saves_output", sa.Boolean(), nullable=False),
        sa.Column("forward_ms", sa.Float(), nullable=True),
        sa.Column("backward_ms", sa.Float(), nullable=True),
        sa.Column("extra", sa.JSON(), nullable=True),
        sa.ForeignKeyConstraint(["trace_id"], ["traces.id"], ondelete="CASCADE",
                                name="fk_trace_stages_trace_id_traces"),
        sa.PrimaryKeyConstraint("trace_id", "position", name="pk_trace_stages"),
    )
    op.create_table(
        "plans",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("architecture_id", sa.Integer(), nullable=False),
        sa.Column("trace_id", sa.Integer(), nullable=False),
        sa.Column("input_shape", sa.String(200), nullable=False),
        sa.Column("dtype", sa.String(32), nullable=False),
        sa.Column("mode", sa.String(8), nullable=False),
        sa.Column("grads", sa.String(8), nullable=False),
        sa.Column("device_class", sa.String(32), nullable=False),
        sa.Column("algorithm", sa.String(64), nullable=False),
        sa.Column("budget_bytes", sa.BigInteger(), nullable=False),
        sa.Column("cost_model", sa.String(32), nullable=False),
        sa.Column("checkpoints", sa.JSON(), nullable=False),
        sa.Column("num_stages", sa.Integer(), nullable=False),
        sa.Column("predicted_peak_bytes", sa.BigInteger(), nullable=False),
        sa.Column("baseline_peak_bytes", sa.BigInteger(), nullable=False),
        sa.Column("recompute_ms", sa.Float(), nullable=True),
        sa.Column("step_ms", sa.Float(), nullable=True),
        sa.Column("extra", sa.JSON(), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.ForeignKeyConstraint(["architecture_id"], ["architectures.id"], ondelete="CASCADE",
                                name="fk_plans_architecture_id_architectures"),
        sa.ForeignKeyConstraint(["trace_id"], ["traces.id"], ondelete="CASCADE",
                                name="fk_plans_trace_id_traces"),
        sa.PrimaryKeyConstraint("id", name="pk_plans"),
        sa.UniqueConstraint("architecture_id", "input_shape", "dtype", "mode", "grads", "device_class",
                            "algorithm", "budget_bytes", name="uq_plans_key"),
    )
    op.create_index("ix_plans_trace_id", "plans", ["trace_id"])
    op.create_table(
        "measurements",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("plan_id", sa.Integer(), nullable=False),
        sa.Column("checkpoints", sa.JSON(), nullable=False),
        sa.Column("device_name", sa.String(200), nullable=True),
        sa.Column("torch_version", sa.String(64), nullable=True),
        sa.Column("measured_peak_bytes", sa.BigInteger(), nullable=True),
        sa.Column("measured_reserved_bytes", sa.BigInteger(), nullable=True),
        sa.Column("baseline_measured_peak_bytes", sa.BigInteger(), nullable=True),
        sa.Column("activation_measured_bytes", sa.BigInteger(), nullable=True),
        sa.Column("baseline_activation_measured_bytes", sa.BigInteger(), nullable=True),
        sa.Column("step_ms", sa.Float(), nullable=True),
        sa.Column("baseline_step_ms", sa.Float(), nullable=True),
        sa.Column("grad_check_passed", sa.Boolean(), nullable=True),
        sa.Column("grad_max_abs_diff", sa.Float(), nullable=True),
        sa.Column("extra", sa.JSON(), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.ForeignKeyConstraint(["plan_id"], ["plans.id"], ondelete="CASCADE",
                                name="fk_measurements_plan_id_plans"),
        sa.PrimaryKeyConstraint("id", name="pk_measurements"),
    )
    op.create_index("ix_measurements_plan_id", "measurements", ["plan_id"])
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("progress", sa.Float(), nullable=False),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("finished_at", TS, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_jobs"),
    )
    op.create_index("ix_jobs_state", "jobs", ["state"])


def downgrade() -> None:
    op.drop_index("ix_jobs_state", table_name="jobs")
    op.drop_table("jobs")
    op.drop_index("ix_measurements_plan_id", table_name="measurements")
    op.drop_table("measurements")
    op.drop_index("ix_plans_trace_id", table_name="plans")
    op.drop_table("plans")
    op.drop_table("trace_stages")
    op.drop_index("ix_traces_signature", table_name="traces")
    op.drop_table("traces")
    op.drop_table("architectures")
