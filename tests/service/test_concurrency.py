"""Concurrent writers of the same plan end with one row per key and see no error (NOTE [idempotent writes])."""

from __future__ import annotations

import threading
from collections.abc import Callable

from sqlalchemy import func, select

from remat.client.plan_key import PlanKey
from remat.service import repository
from remat.service.db import Database
from remat.service.models import Architecture, PlanRow, TraceRow
from remat.service.records import Measurement
from tests.service.factories import fixed_plans, make_trace

NUM_WRITERS = 8
ALGORITHMS = ("chen-sqrt", "cubic", "linear", "none", "uniform")


def _run_together(target: Callable[[int], None], count: int = NUM_WRITERS) -> list[BaseException]:
    """Start ``count`` threads at one barrier; return what they raised."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(count)

    def run(i: int) -> None:
        try:
            barrier.wait()
            target(i)
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return errors


def test_concurrent_writers_of_the_same_plans(db_url: str) -> None:
    """Half the writers store one trace, half a re-profile of the same key: one row per plan key remains.

    Every writer has its own engine (its own connections), as separate worker processes would. Plans are
    listed in a different order by each writer, which is what could deadlock PostgreSQL without sorting.
    """
    traces = [make_trace(scale=1), make_trace(scale=2)]

    def write(i: int) -> None:
        db = Database(db_url)
        try:
            trace = traces[i % 2]
            plans = fixed_plans(trace, ALGORITHMS[i % 5:] + ALGORITHMS[:i % 5])
            with db.write_session() as session:
                stored = repository.store_trace(session=session, trace=trace)
                repository.store_plans(session=session, trace_id=stored.trace_id, plans=plans)
        finally:
            db.dispose()

    assert _run_together(write) == []
    db = Database(db_url)
    try:
        with db.read_session() as session:
            count = session.execute(select(func.count()).select_from(PlanRow)).scalar_one()
            traces_stored = session.execute(select(func.count()).select_from(TraceRow)).scalar_one()
            archs = session.execute(select(func.count()).select_from(Architecture)).scalar_one()
        assert (count, traces_stored, archs) == (len(ALGORITHMS), 2, 1)
    finally:
        db.dispose()


def test_concurrent_requests_through_one_engine(db: Database) -> None:
    """The service's case: threads of one process sharing a pool, storing and measuring the same plan."""
    trace = make_trace()
    key = PlanKey.from_trace(trace)

    def write(i: int) -> None:
        with db.write_session() as session:
            stored = repository.store_trace(session=session, trace=trace)
            repository.store_plans(session=session, trace_id=stored.trace_id, plans=fixed_plans(trace))
        with db.write_session() as session:
            repository.store_measurement(session=session, key=key, algorithm="linear",
                                         measurement=Measurement(measured_peak_bytes=i))

    assert _run_together(write) == []
    with db.read_session() as session:
        record = repository.get_plan(session=session, key=key, algorithm="linear")
        assert session.execute(select(func.count()).select_from(PlanRow)).scalar_one() == 2
    assert record is not None and len(record.measurements) == NUM_WRITERS
