"""ORM tables of the plan database (SQLAlchemy 2 declarative mapping).

Tables: ``architectures`` (one row per architecture hash), ``traces`` (one per distinct trace content) with
their per-stage rows in ``trace_stages``, ``plans`` (one per plan key), ``measurements`` (validation runs of a
plan) and ``jobs`` (profiling requests). The schema itself is created by the Alembic migrations in
``migrations/``; these classes must match them (tests/service/test_migrations.py checks that they do).

NOTE [plan key]: a plan is stored once per (architecture, input shape, call inputs, dtype, mode, gradient
convention, device class, torch version, algorithm, budget): the plan key (client/plan_key.py). "No budget"
(minimise the peak) is stored as ``budget_bytes = 0`` rather than NULL, because a unique constraint treats
NULLs as distinct (SQLite, and PostgreSQL by default) and would let two "no budget" rows coexist. No plan
fits in 0 bytes, so 0 is free.
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
    false,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

from remat.client.job_state import ACTIVE_JOB_STATES
from remat.client.plan_key import MAX_INPUTS_CHARS

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
        Index("ix_traces_signature", "architecture_id", "input_shape", "inputs", "dtype", "mode", "grads",
              "device_class"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    architecture_id: Mapped[int] = mapped_column(ForeignKey("architectures.id", ondelete="CASCADE"))
    content_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    input_shape: Mapped[str] = mapped_column(String(200))
    """Full input shape, batch included, as comma-separated ints (``32,3,224,224``)."""
    inputs: Mapped[str] = mapped_column(String(MAX_INPUTS_CHARS), default="", server_default="")
    """The training call's signature (``PlanKey.inputs``); empty for a call of one positional tensor."""
    dtype: Mapped[str] = mapped_column(String(32))
    mode: Mapped[str] = mapped_column(String(8))
    grads: Mapped[str] = mapped_column(String(8))
    device_class: Mapped[str] = mapped_column(String(32))
    device_name: Mapped[str | None] = mapped_column(String(200))
    torch_version: Mapped[str | None] = mapped_column(String(64))
    """The full version string the trace recorded; plans key on its major.minor (``plans.torch_version``)."""
    input_bytes: Mapped[int] = mapped_column(BigInteger)
    num_stages: Mapped[int] = mapped_column(Integer)
    trace_metadata: Mapped[dict[str, Any]] = mapped_column("metadata", JSON)
    """Every top-level metadata field of the trace as received, unknown ones included."""
    graph: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    """The trace's op graph (``TraceGraph.to_dict()``), NULL when it has none."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    stages: Mapped[list[TraceStageRow]] = relationship(
        order_by="TraceStageRow.position", cascade="all, delete-orphan", passive_deletes=True)


class TraceStageRow(Base):
    """One stage of a trace: the per-layer memory (and time) figures the planners read.

    One column per field of ``remat.client.trace.Stage`` (tests/service/test_migrations.py holds the two
    lists equal); fields a profiler adds beyond those go to ``extra``.
    """

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
    forward_peak_dropped_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    recomputed_backward_peak_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    cast_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    cast_unsaved_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    saves_input: Mapped[bool] = mapped_column(Boolean, default=False)
    saves_output: Mapped[bool] = mapped_column(Boolean, default=False)
    saves_nothing: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    forward_ms: Mapped[float | None] = mapped_column(Float)
    backward_ms: Mapped[float | None] = mapped_column(Float)
    recompute_ms: Mapped[float | None] = mapped_column(Float)
    extra: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class PlanRow(Base):
    """The plan for one plan key; a later trace for the same key replaces it (latest profile wins)."""

    __tablename__ = "plans"
    __table_args__ = (
        UniqueConstraint("architecture_id", "input_shape", "inputs", "dtype", "mode", "grads", "device_class",
                         "torch_version", "algorithm", "budget_bytes", name="uq_plans_key"),
        # One row per plan key (its ``none`` plan), newest first: the web pages' architectures table.
        Index("ix_plans_listing", "algorithm", "budget_bytes", "updated_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    architecture_id: Mapped[int] = mapped_column(ForeignKey("architectures.id", ondelete="CASCADE"))
    trace_id: Mapped[int] = mapped_column(ForeignKey("traces.id", ondelete="CASCADE"), index=True)
    input_shape: Mapped[str] = mapped_column(String(200))
    inputs: Mapped[str] = mapped_column(String(MAX_INPUTS_CHARS), default="", server_default="")
    """The training call's signature (``PlanKey.inputs``); empty for a call of one positional tensor."""
    dtype: Mapped[str] = mapped_column(String(32))
    mode: Mapped[str] = mapped_column(String(8))
    grads: Mapped[str] = mapped_column(String(8))
    device_class: Mapped[str] = mapped_column(String(32))
    torch_version: Mapped[str] = mapped_column(String(16), default="unknown", server_default="unknown")
    """torch major.minor of the trace the plan was computed from (``unknown`` when it did not say)."""
    algorithm: Mapped[str] = mapped_column(String(64))
    budget_bytes: Mapped[int] = mapped_column(BigInteger, default=NO_BUDGET)
    """See NOTE [plan key]: 0 means no budget."""
    cost_model: Mapped[str] = mapped_column(String(32))
    checkpoints: Mapped[list[int]]
    num_stages: Mapped[int] = mapped_column(Integer)
    dropped_vertices: Mapped[list[int] | None] = mapped_column(JSON(none_as_null=True))
    """A graph plan's recomputed op-graph vertices (``Plan.dropped_vertices``); NULL for a chain plan."""
    num_vertices: Mapped[int | None] = mapped_column(Integer)
    predicted_peak_bytes: Mapped[int] = mapped_column(BigInteger)
    baseline_peak_bytes: Mapped[int] = mapped_column(BigInteger)
    recompute_ms: Mapped[float | None] = mapped_column(Float)
    step_ms: Mapped[float | None] = mapped_column(Float)
    extra: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class MeasurementRow(Base):
    """One validation run of a plan: a real training step with the plan applied.

    One column per field of ``remat.client.measurement.STORED_FIELDS`` (tests/service/test_migrations.py
    holds the two lists equal); algorithm, precision, gradient convention and device are the plan's.
    """

    __tablename__ = "measurements"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    plan_id: Mapped[int] = mapped_column(ForeignKey("plans.id", ondelete="CASCADE"), index=True)
    checkpoints: Mapped[list[int]]
    """The checkpoints that were measured: a later profile may change the plan's own."""
    dropped_vertices: Mapped[list[int] | None] = mapped_column(JSON(none_as_null=True))
    """A graph plan's measured op-graph vertices; NULL for a chain plan."""
    predicted_peak_bytes: Mapped[int | None] = mapped_column(BigInteger)
    measured_peak_bytes: Mapped[int | None] = mapped_column(BigInteger)
    """Activation peak: highest allocation during the step minus the allocation just before it."""
    baseline_predicted_peak_bytes: Mapped[int | None] = mapped_column(BigInteger)
    baseline_measured_peak_bytes: Mapped[int | None] = mapped_column(BigInteger)
    absolute_peak_bytes: Mapped[int | None] = mapped_column(BigInteger)
    measured_reserved_bytes: Mapped[int | None] = mapped_column(BigInteger)
    requested_peak_bytes: Mapped[int | None] = mapped_column(BigInteger)
    step_ms: Mapped[float | None] = mapped_column(Float)
    baseline_step_ms: Mapped[float | None] = mapped_column(Float)
    step_spread_ms: Mapped[float | None] = mapped_column(Float)
    baseline_step_spread_ms: Mapped[float | None] = mapped_column(Float)
    device_name: Mapped[str | None] = mapped_column(String(200))
    torch_version: Mapped[str | None] = mapped_column(String(64))
    grad_check_passed: Mapped[bool | None] = mapped_column(Boolean)
    grad_max_abs_diff: Mapped[float | None] = mapped_column(Float)
    extra: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


_ACTIVE_LEADER = f"leader_id IS NULL AND state IN ({', '.join(repr(s.value) for s in ACTIVE_JOB_STATES)})"
"""A job that leads and has not ended; the same text as migration 0003's partial index."""


class JobRow(Base):
    """A profiling (or planning) request and its progress, written by the API and advanced by the worker.

    NOTE [job lease] A worker runs a job only while it holds the lease (``lease_owner`` until
    ``lease_expires_at``), which a heartbeat extends; every write of the job's progress and of its result
    is conditional on holding it, so a second delivery of the same task never runs it twice and never writes
    a second set of rows. A lease that expires (the worker was killed) lets the reaper queue the job again;
    ``attempts`` counts the leases taken, so a job that kills its worker every time fails after
    ``job_max_attempts`` instead of coming back forever. Equal requests share one run: the first active job
    of a ``request_key`` leads (the partial unique index allows one), later ones follow it
    (``leader_id``) and finish with it.
    """

    __tablename__ = "jobs"
    __table_args__ = (
        Index("uq_jobs_active_request", "request_key", unique=True, sqlite_where=text(_ACTIVE_LEADER),
              postgresql_where=text(_ACTIVE_LEADER)),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), default="profile", server_default="profile")
    """``profile`` (a model request) or ``plan`` (planners too slow to run inside an upload)."""
    state: Mapped[str] = mapped_column(String(16), index=True)
    request_key: Mapped[str | None] = mapped_column(String(64), index=True)
    """sha256 of the canonical request: equal requests share one run."""
    leader_id: Mapped[str | None] = mapped_column(String(36))
    """The job whose run this one waits for (a follower), or None."""
    queue: Mapped[str | None] = mapped_column(String(64))
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    enqueued_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    plan_key: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    """The plan key, once a worker has built the model and computed it."""
    progress: Mapped[float] = mapped_column(Float, default=0.0)
    message: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    request: Mapped[dict[str, Any]]
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    """Jobs are listed newest first (``ix_jobs_created_at``)."""
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class ZooBatchRow(Base):
    """A zoo run submitted to the service (``POST /v1/zoo``): one job per selected model.

    The batch records what was asked (zoo, filter, the request every model shares); its progress and
    results are read from its jobs, which stay the one record of each model's run.
    """

    __tablename__ = "zoo_batches"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    zoo: Mapped[str] = mapped_column(String(32))
    filter: Mapped[str | None] = mapped_column(String(200))
    request: Mapped[dict[str, Any]]
    """What every model shares: batch_size (or null), input_shape (or null), device, grads, dtype, queue,
    refresh."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    jobs: Mapped[list[ZooBatchJobRow]] = relationship(order_by="ZooBatchJobRow.position",
                                                      cascade="all, delete-orphan")


class ZooBatchJobRow(Base):
    """A model of a zoo batch and the job that runs it (a follower when another job runs the same request)."""

    __tablename__ = "zoo_batch_jobs"

    batch_id: Mapped[str] = mapped_column(ForeignKey("zoo_batches.id", ondelete="CASCADE"), primary_key=True)
    position: Mapped[int] = mapped_column(Integer, primary_key=True)
    model: Mapped[str] = mapped_column(String(200))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
