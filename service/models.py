"""ORM tables of the plan database (SQLAlchemy 2 declarative mapping).

Tables: ``architectures`` (one row per architecture hash), ``traces`` (one per distinct trace content) with
their per-stage rows in ``trace_stages``, ``plans`` (one per plan key), ``measurements`` (validation runs of a
plan) and ``jobs`` (profiling requests). The schema itself is created by the Alembic migrations in
``migrations/``; these classes must match them (tests/service/test_migrations.py checks that they do).

NOTE [plan key]: a plan is stored once per (architecture, input shape, dtype, mode, gradient convention,
device class, algorithm, budget), the key of design.md. "No budget" (minimise the peak) is stored as
``budget_bytes = 0`` rather than NULL, because a unique constraint treats NULLs as distinct (SQLite, and
PostgreSQL by default) and would let two "no budget" rows coexist. No plan fits in 0 bytes, so 0 is free.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

NO_BUDGET = 0
"""``plans.budget_bytes`` of a plan computed without a budget; see NOTE [plan key]."""

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp on every backend (SQLite hands back naive values otherwise)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(UTC)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSON(), list[int]: JSON()}


class Architecture(Base):
    """A network architecture, identified by the client's architecture hash (weights excluded)."""

    __tablename__ = "architectures"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    hash: Mapped[str] = mapped_column(String(128), unique=True)
    name: Mapped[str | None] = mapped_column(String(200))
    graph_summary: Mapped[dict[str, Any]]
    """Stage count and a digest of the stage names: enough to notice two graphs sharing a hash."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class TraceRow(Base):
    """One layer memory trace, stored once per distinct content (``content_sha256``)."""

    __tablename__ = "traces"
    __table_args__ = (
        Index("ix_traces_signature", "architecture_id", "input_shape", "dtype", "mode", "grads", "device_class"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    architecture_id: Mapped[int] = mapped_column(ForeignKey("architectures.id", ondelete="CASCADE"))
    content_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    input_shape: Mapped[str] = mapped_column(String(200))
    """Full input shape, batch included, as comma-separated ints (``32,3,224,224``)."""
    dtype: Mapped[str] = mapped_column(String(32))
    mode: Mapped[str] = mapped_column(String(8))
    grads: Mapped[str] = mapped_column(String(8))
    device_class: Mapped[str] = mapped_column(String(32))
    device_name: Mapped[str | None] = mapped_column(String(200))
    torch_version: Mapped[str | None] = mapped_column(String(64))
    batch_size: Mapped[int | None] = mapped_column(Integer)
    input_bytes: Mapped[int] = mapped_column(BigInteger)
    num_stages: Mapped[int] = mapped_column(Integer)
    trace_metadata: Mapped[dict[str, Any]] = mapped_column("metadata", JSON)
    """Every top-level metadata field of the trace as received, unknown ones included."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    stages: Mapped[list[TraceStageRow]] = relationship(
        order_by="TraceStageRow.position", cascade="all, delete-orphan", passive_deletes=True)


class TraceStageRow(Base):
    """One stage of a trace: the per-layer memory (and time) figures the planners read."""

    __tablename__ = "trace_stages"

    trace_id: Mapped[int] = mapped_column(ForeignKey("traces.id", ondelete="CASCADE"), primary_key=True)
    position: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(Text)
    output_bytes: Mapped[int] = mapped_column(BigInteger)
    saved_bytes: Mapped[int] = mapped_column(BigInteger)
    forward_peak_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    recompute_peak_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    backward_peak_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    param_grad_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    saves_input: Mapped[bool] = mapped_column(Boolean, default=False)
    saves_output: Mapped[bool] = mapped_column(Boolean, default=False)
    forward_ms: Mapped[float | None] = mapped_column(Float)
    backward_ms: Mapped[float | None] = mapped_column(Float)
    extra: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class PlanRow(Base):
    """The plan for one plan key; a later trace for the same key replaces it (latest profile wins)."""

    __tablename__ = "plans"
    __table_args__ = (
        UniqueConstraint("architecture_id", "input_shape", "dtype", "mode", "grads", "device_class",
                         "algorithm", "budget_bytes", name="uq_plans_key"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    architecture_id: Mapped[int] = mapped_column(ForeignKey("architectures.id", ondelete="CASCADE"))
    trace_id: Mapped[int] = mapped_column(ForeignKey("traces.id", ondelete="CASCADE"), index=True)
    input_shape: Mapped[str] = mapped_column(String(200))
    dtype: Mapped[str] = mapped_column(String(32))
    mode: Mapped[str] = mapped_column(String(8))
    grads: Mapped[str] = mapped_column(String(8))
    device_class: Mapped[str] = mapped_column(String(32))
    algorithm: Mapped[str] = mapped_column(String(64))
    budget_bytes: Mapped[int] = mapped_column(BigInteger, default=NO_BUDGET)
    """See NOTE [plan key]: 0 means no budget."""
    cost_model: Mapped[str] = mapped_column(String(32))
    checkpoints: Mapped[list[int]]
    num_stages: Mapped[int] = mapped_column(Integer)
    predicted_peak_bytes: Mapped[int] = mapped_column(BigInteger)
    baseline_peak_bytes: Mapped[int] = mapped_column(BigInteger)
    recompute_ms: Mapped[float | None] = mapped_column(Float)
    step_ms: Mapped[float | None] = mapped_column(Float)
    extra: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class MeasurementRow(Base):
    """One validation run of a plan: a real training step with the plan applied."""

    __tablename__ = "measurements"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    plan_id: Mapped[int] = mapped_column(ForeignKey("plans.id", ondelete="CASCADE"), index=True)
    checkpoints: Mapped[list[int]]
    """The checkpoints that were measured: a later profile may change the plan's own."""
    device_name: Mapped[str | None] = mapped_column(String(200))
    torch_version: Mapped[str | None] = mapped_column(String(64))
    measured_peak_bytes: Mapped[int | None] = mapped_column(BigInteger)
    """Peak allocated bytes (``torch.cuda.max_memory_allocated`` or live-tensor accounting on CPU)."""
    measured_reserved_bytes: Mapped[int | None] = mapped_column(BigInteger)
    baseline_measured_peak_bytes: Mapped[int | None] = mapped_column(BigInteger)
    activation_measured_bytes: Mapped[int | None] = mapped_column(BigInteger)
    baseline_activation_measured_bytes: Mapped[int | None] = mapped_column(BigInteger)
    step_ms: Mapped[float | None] = mapped_column(Float)
    baseline_step_ms: Mapped[float | None] = mapped_column(Float)
    grad_check_passed: Mapped[bool | None] = mapped_column(Boolean)
    grad_max_abs_diff: Mapped[float | None] = mapped_column(Float)
    extra: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class JobRow(Base):
    """A profiling request and its progress, written by the API and advanced by the worker."""

    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    state: Mapped[str] = mapped_column(String(16), index=True)
    progress: Mapped[float] = mapped_column(Float, default=0.0)
    message: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    request: Mapped[dict[str, Any]]
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
