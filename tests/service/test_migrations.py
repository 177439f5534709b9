"""Alembic migrations: up and down on both backends, models in step with them, safe first use."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from remat.service import migrate
from remat.service.db import Database
from remat.service.errors import SchemaOutdatedError
from remat.service.models import Base
from remat.service.store import PlanStore

TABLES = {"architectures", "traces", "trace_stages", "plans", "measurements", "jobs", "zoo_batches", "zoo_batch_jobs"}


@pytest.fixture(params=["sqlite", "postgresql"])
def fresh_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database that no migration has touched."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'fresh.sqlite'}"
    factory: Callable[[], str] = request.getfixturevalue("pg_database_factory")
    return factory()


def _tables(db: Database) -> set[str]:
    return set(inspect(db.engine).get_table_names()) - {"alembic_version"}


def test_head_constant_is_alembics_head() -> None:
    assert migrate.HEAD_REVISION == migrate.head_revision()


def test_upgrade_downgrade_upgrade(fresh_url: str) -> None:
    db = Database(fresh_url)
    try:
        assert migrate.current_revision(db) is None
        migrate.upgrade(db)
        assert migrate.current_revision(db) == migrate.head_revision()
        assert _tables(db) == TABLES
        migrate.downgrade(db, "base")
        assert migrate.current_revision(db) is None
        assert _tables(db) == set()
        migrate.upgrade(db)
        assert _tables(db) == TABLES
    finally:
        db.dispose()


def test_models_match_migrations(fresh_url: str) -> None:
    """The ORM classes and the migrations describe the same schema (autogenerate finds nothing to do)."""
    db = Database(fresh_url)
    try:
        migrate.upgrade(db)
        with db.engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
        assert diff == []
    finally:
        db.dispose()


def test_ensure_current_migrates_once(sqlite_url: str) -> None:
    db = Database(sqlite_url)
    try:
        assert migrate.ensure_current(db) is True
        assert migrate.ensure_current(db) is False
    finally:
        db.dispose()


def test_concurrent_first_use_of_a_sqlite_file(sqlite_url: str) -> None:
    """Several CLI processes opening a fresh file at once: one migrates, the others wait; none fails."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def open_store() -> None:
        try:
            barrier.wait()
            with PlanStore(sqlite_url) as store:
                assert store.get_job("00000000-0000-0000-0000-000000000000") is None
        except BaseException as exc:  # collected and asserted on below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=open_store) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    db = Database(sqlite_url)
    assert migrate.current_revision(db) == migrate.head_revision()
    db.dispose()


def test_store_does_not_migrate_postgres_by_itself(pg_database_factory: Callable[[], str]) -> None:
    url = pg_database_factory()
    with pytest.raises(SchemaOutdatedError, match=r"remat-service migrate"):
        PlanStore(url).open()
    with PlanStore(url, auto_migrate=True) as store:
        assert store.get_job("00000000-0000-0000-0000-000000000000") is None


def test_trace_stage_columns_are_the_trace_formats_fields() -> None:
    """One definition of a stage: every field of remat-trace/1 has its column, and nothing else does."""
    from remat.client.trace import STAGE_FIELDS
    from remat.service.models import TraceStageRow

    columns = {c.name for c in TraceStageRow.__table__.columns} - {"trace_id", "position", "extra"}
    assert columns == set(STAGE_FIELDS)


def test_stage_fields_survive_0002_down_and_up(fresh_url: str) -> None:
    """0002 adds the GPU-calibration stage fields: rows stored before it read back with their defaults, and a
    downgrade to 0001 keeps the rows while dropping only those columns."""
    from remat.client.trace import TRACE_FORMAT, parse_trace
    from remat.service import repository

    trace = parse_trace({"format": TRACE_FORMAT, "input_bytes": 8, "model_hash": "arch", "input_shape": [2, 4],
                         "dtype": "autocast_bfloat16", "device": "cuda", "stages": [
                             {"name": "view", "output_bytes": 4, "saved_bytes": 0, "saves_nothing": True},
                             {"name": "linear", "output_bytes": 4, "saved_bytes": 8, "cast_bytes": 6,
                              "cast_unsaved_bytes": 2, "forward_peak_dropped_bytes": 5,
                              "recomputed_backward_peak_bytes": 9, "backward_peak_bytes": 11}]})
    db = Database(fresh_url)
    try:
        migrate.upgrade(db)
        with db.write_session() as session:
            trace_id = repository.store_trace(session=session, trace=trace).trace_id
        with db.read_session() as session:
            assert repository.load_trace(session=session, trace_id=trace_id) == trace
        migrate.downgrade(db, "0001")
        assert "cast_bytes" not in {c["name"] for c in inspect(db.engine).get_columns("trace_stages")}
        migrate.upgrade(db)
        with db.read_session() as session:
            reloaded = repository.load_trace(session=session, trace_id=trace_id)
        assert reloaded is not None
        assert [s.name for s in reloaded.stages] == ["view", "linear"]
        assert reloaded.stages[1].backward_peak_bytes == 11
        assert (reloaded.stages[0].saves_nothing, reloaded.stages[1].cast_bytes,
                reloaded.stages[1].recomputed_backward_peak_bytes) == (False, 0, 0)
    finally:
        db.dispose()


def test_0003_keeps_plans_and_measurements_down_and_up(fresh_url: str) -> None:
    """0003 rebuilds plans and measurements (SQLite copies tables to alter them): rows and their references
    survive both ways, the dropped duplicate columns come back equal to the ones they duplicated, and plans
    key on the trace's torch major.minor again after the round trip."""
    from sqlalchemy import text

    from remat.client.measurement import Measurement
    from remat.client.plan_key import PlanKey
    from remat.service import repository
    from tests.service.factories import fixed_plans, make_trace

    trace = make_trace(torch_version="2.11.0+cu130")
    plans = fixed_plans(trace)
    db = Database(fresh_url)
    try:
        migrate.upgrade(db)
        with db.write_session() as session:
            stored = repository.store_profile(session=session, trace=trace, plans=plans, measurements={
                "linear": Measurement(measured_peak_bytes=4000, baseline_measured_peak_bytes=9000, step_ms=2.0)})
        assert stored.key.torch_version == "2.11"
        migrate.downgrade(db, "0002")
        with db.engine.connect() as conn:
            rows = conn.execute(text("SELECT activation_measured_bytes, baseline_activation_measured_bytes "
                                     "FROM measurements")).all()
            assert [tuple(r) for r in rows] == [(4000, 9000)]
            assert conn.execute(text("SELECT COUNT(*) FROM plans")).scalar_one() == 2
            assert conn.execute(text("SELECT batch_size FROM traces")).scalar_one() is None  # the trace had none
        migrate.upgrade(db)
        with db.read_session() as session:
            record = repository.get_plan(session=session, key=PlanKey.from_trace(trace), algorithm="linear")
        assert record is not None and record.key.torch_version == "2.11"
        assert [m.measured_peak_bytes for m in record.measurements] == [4000]
    finally:
        db.dispose()


def test_0006_keys_plans_on_the_call_inputs_down_and_up(fresh_url: str) -> None:
    """0006 adds the call's signature to the plan key: a downgrade drops what the older schema cannot tell
    from a single-tensor call (plans, their measurements, traces and stages of several-input calls) and keeps
    the rest; an upgrade keys a trace that recorded its signature before (and its plans) on that signature."""
    from sqlalchemy import text

    from remat.client.measurement import Measurement
    from remat.client.plan_key import PlanKey
    from remat.service import repository
    from tests.service.factories import fixed_plans, make_trace

    signature = "input_ids: int64[8, 3]; attention_mask: int64[8, 3]; use_cache=False"
    one_tensor = make_trace()
    several = make_trace(inputs=signature, scale=2)
    measured = {"linear": Measurement(measured_peak_bytes=4000, baseline_measured_peak_bytes=9000)}
    db = Database(fresh_url)
    try:
        migrate.upgrade(db)
        with db.write_session() as session:
            kept = repository.store_profile(session=session, trace=one_tensor, plans=fixed_plans(one_tensor),
                                            measurements=measured)
            gone = repository.store_profile(session=session, trace=several, plans=fixed_plans(several),
                                            measurements=measured)
        assert (kept.key.inputs, gone.key.inputs) == ("", signature)
        migrate.downgrade(db, "0005")
        assert "inputs" not in {c["name"] for c in inspect(db.engine).get_columns("plans")}
        with db.engine.connect() as conn:
            assert conn.execute(text("SELECT id FROM traces")).scalars().all() == [kept.trace_id]
            assert conn.execute(text("SELECT DISTINCT trace_id FROM trace_stages")).scalars().all() == [
                kept.trace_id]
            assert conn.execute(text("SELECT DISTINCT trace_id FROM plans")).scalars().all() == [kept.trace_id]
            assert conn.execute(text("SELECT COUNT(*) FROM measurements")).scalar_one() == 1
        migrate.upgrade(db)
        with db.read_session() as session:
            record = repository.get_plan(session=session, key=kept.key, algorithm="linear")
            assert repository.get_plan(session=session, key=gone.key, algorithm="linear") is None
        assert record is not None and record.key == kept.key
        assert [m.measured_peak_bytes for m in record.measurements] == [4000]

        # A trace that recorded its signature while the service did not key on it (stored as ""): the upgrade
        # keys it, and the plans computed from it, on the recorded signature.
        recorded = make_trace(inputs=signature, input_shape=(16, 3))
        with db.write_session() as session:
            early = repository.store_profile(session=session, trace=recorded, plans=fixed_plans(recorded),
                                             measurements={})
        with db.engine.begin() as conn:
            conn.execute(text("UPDATE plans SET inputs = ''"))
            conn.execute(text("UPDATE traces SET inputs = ''"))
        migrate.downgrade(db, "0005")
        with db.engine.connect() as conn:
            assert conn.execute(text("SELECT COUNT(*) FROM plans")).scalar_one() == 4  # nothing keyed on inputs
        migrate.upgrade(db)
        with db.read_session() as session:
            early_record = repository.get_plan(session=session, key=early.key, algorithm="linear")
            one_record = repository.get_plan(session=session, key=kept.key, algorithm="linear")
        assert early_record is not None and early_record.trace.trace_id == early.trace_id
        assert early_record.key == PlanKey.from_trace(recorded) and early.key.inputs == signature
        assert one_record is not None and one_record.trace.trace_id == kept.trace_id
    finally:
        db.dispose()


def test_measurement_columns_are_the_measurement_records_fields() -> None:
    """One definition of a measurement: the table stores exactly remat.client.measurement's stored fields."""
    from remat.client.measurement import STORED_FIELDS
    from remat.service.models import MeasurementRow

    columns = {c.name for c in MeasurementRow.__table__.columns} - {"id", "plan_id", "created_at"}
    assert columns == set(STORED_FIELDS)


def test_api_key_and_measurement_schemas_derive_from_the_records() -> None:
    from remat.client.measurement import STORED_FIELDS, Measurement
    from remat.client.plan_key import KEY_FIELDS
    from remat.service.models import PlanRow
    from remat.service.schemas import MeasurementCreate, MeasurementOut, PlanKeyIn, PlanKeyOut

    assert set(PlanKeyIn.model_fields) == set(PlanKeyOut.model_fields) == set(KEY_FIELDS)
    key_columns = {"input_shape", "inputs", "dtype", "mode", "grads", "device_class", "torch_version"}
    assert key_columns <= {c.name for c in PlanRow.__table__.columns}  # + model_hash via the architecture
    assert set(MeasurementOut.model_fields) == set(Measurement().to_dict())
    assert set(MeasurementCreate.model_fields) == {"key", "algorithm", "budget_bytes", *STORED_FIELDS}


def test_0009_adds_the_points_below_the_chains_to_frontiers_stored_without_them(fresh_url: str) -> None:
    """A frontier stored before 0009 has chain points only. The upgrade adds what the write path stores today
    (``with_points_below_chains``): a nested plan and a graph plan below every chain point, each a ``budget`` row
    at its own peak with its source plan's measurement; a frontier that has them is left alone."""
    from dataclasses import replace

    from sqlalchemy import select, text

    from remat.client.measurement import Measurement
    from remat.client.plan import Plan
    from remat.client.plan_key import PlanKey
    from remat.client.planning.plans import plans_to_store, with_points_below_chains
    from remat.service import repository
    from remat.service.models import PlanRow
    from tests.client.planning.test_max_batch import NESTING_WINS
    from tests.client.test_derived_trace import profile

    trace = profile(8, NESTING_WINS, torch_version="2.15")
    plans = plans_to_store(trace)
    least = min(p.predicted_peak_bytes for p in plans if p.nested)
    graph = Plan(algorithm="acg", cost_model="pytorch", checkpoints=(), predicted_peak_bytes=least - 4096,
                 baseline_peak_bytes=plans[0].baseline_peak_bytes, num_stages=trace.num_stages,
                 dropped_vertices=(1, 2), num_vertices=9)
    plans = with_points_below_chains([p for p in plans if p.algorithm != "acg"] + [graph])
    below = [p for p in plans if p.budget_bytes and p.runs_as[0] != "chain"]
    assert sorted(p.runs_as[0] for p in below) == ["graph", "nested"]
    sources = {p.runs_as: p for p in plans if not p.budget_bytes}
    measured = {p.label: Measurement(checkpoints=p.checkpoints, dropped_vertices=p.dropped_vertices,
                                     measured_peak_bytes=p.predicted_peak_bytes + 8)
                for p in plans if p.runs_as[0] != "chain" and not (p.budget_bytes and p.runs_as not in sources)}
    other = profile(8, NESTING_WINS, torch_version="2.15", model_hash="h2")  # a second key, stored the same
    keys = [PlanKey.from_trace(trace), PlanKey.from_trace(other)]

    def frontier() -> list[list[tuple[dict[str, Any], list[int | None]]]]:
        with db.read_session() as session:
            return [[(r.plan.to_dict(), [m.measured_peak_bytes for m in r.measurements])
                     for r in repository.find_frontier(session=session, key=key)] for key in keys]

    db = Database(fresh_url)
    try:
        migrate.upgrade(db)
        with db.write_session() as session:
            for profiled in (trace, other):
                repository.store_profile(session=session, trace=profiled, plans=plans, measurements=measured)
        both = frontier()
        assert both[0] == both[1]
        expected = both[0]
        assert [d for d, _ in expected if d.get("nested") or d.get("dropped_vertices")] == [
            replace(p, algorithm="budget").to_dict() for p in sorted(below, key=lambda p: p.predicted_peak_bytes)]
        chains = min(p.predicted_peak_bytes for p in plans if p.budget_bytes and p.runs_as[0] == "chain")
        assert all(m == [d["predicted_peak_bytes"] + 8] for d, m in expected if d["predicted_peak_bytes"] < chains)
        stale = f"algorithm = 'budget' AND budget_bytes < {chains}"
        with db.engine.begin() as conn:  # as a store written before 9753cb3 holds it
            conn.execute(text(f"DELETE FROM measurements WHERE plan_id IN (SELECT id FROM plans WHERE {stale})"))
            assert conn.execute(text(f"DELETE FROM plans WHERE {stale}")).rowcount == 4
        assert [len(f) for f in frontier()] == [len(expected) - 2] * 2
        migrate.downgrade(db, "0008")
        migrate.upgrade(db)
        assert frontier() == [expected, expected]
        with db.engine.connect() as conn:  # the nested points' vertices are SQL NULL, as the ORM writes them
            assert conn.execute(text(f"SELECT COUNT(*) FROM plans WHERE {stale} AND dropped_vertices IS NULL")
                                ).scalar_one() == 2
        migrate.downgrade(db, "0008")  # again: a frontier with its points is left as it is
        migrate.upgrade(db)
        assert frontier() == [expected, expected]
        with db.write_session() as session:  # points stored before they named their planner: named now
            for row in session.scalars(select(PlanRow).where(text(stale))):
                row.extra = {k: v for k, v in row.extra.items() if k != "planned_by"}
        assert frontier() != [expected, expected]
        migrate.downgrade(db, "0008")
        migrate.upgrade(db)
        assert frontier() == [expected, expected]
    finally:
        db.dispose()
