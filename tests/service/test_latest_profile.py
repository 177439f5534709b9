"""Latest profile wins: a re-profile and a late plan job, in either order, leave one consistent plan set.

Every plan of a key comes from its newest trace (NOTE [latest profile wins] in service/repository.py): a
``plan`` job that runs after a newer trace of its key was stored writes nothing, and says so.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from remat.client.plan import Plan
from remat.client.plan_key import PlanKey
from remat.client.trace import Trace
from remat.service import repository
from remat.service.config import ServiceSettings
from remat.service.db import Database
from remat.worker import tasks
from tests.service.factories import AUTH, fixed_plans, make_trace, trace_dict
from tests.service.interleave import Side, Stop, finished_or_blocked

KEY = PlanKey.from_trace(make_trace())
QUERY = {"input_shape": "8,3,32,32", "dtype": "float32", "device": "cpu"}


def _trace_ids(db: Database) -> dict[str, set[int]]:
    """Which traces the key's stored plans come from, per algorithm."""
    with db.read_session() as session:
        records = repository.find_plans(session=session, key=KEY)
    out: dict[str, set[int]] = {}
    for record in records:
        out.setdefault(record.plan.algorithm, set()).add(record.trace.trace_id)
    return out


@pytest.mark.parametrize("late", ["before the re-profile", "between the re-profile and its job",
                                  "after the re-profile's job"])
def test_a_late_plan_job_never_mixes_two_profiles(make_client: Callable[..., TestClient],
                                                  make_settings: Callable[..., ServiceSettings],
                                                  db: Database, late: str) -> None:
    """Two uploads of the same key, each deferring ``cubic`` to a ``plan`` job; the first upload's job runs
    late. Whenever it runs, the key ends with every plan from the second trace."""
    settings = make_settings(inline_cubic_stages=2)  # the 6-stage test traces defer cubic
    client = make_client(inline_cubic_stages=2)
    task = SimpleNamespace(app=SimpleNamespace(remat_settings=settings), request=SimpleNamespace(retries=0))

    first = client.post("/v1/traces", json=trace_dict(scale=1), headers=AUTH).json()
    (late_job,) = [d["job_id"] for d in first["deferred"]]
    outcomes = []
    if late == "before the re-profile":
        outcomes.append(tasks.plan_trace(task, late_job))
    second = client.post("/v1/traces", json=trace_dict(scale=2), headers=AUTH).json()
    assert second["created"] and second.get("superseded_by") is None
    (own_job,) = [d["job_id"] for d in second["deferred"]]
    if late == "between the re-profile and its job":
        outcomes.append(tasks.plan_trace(task, late_job))
    assert tasks.plan_trace(task, own_job) == "succeeded"
    if late == "after the re-profile's job":
        outcomes.append(tasks.plan_trace(task, late_job))

    newest = second["trace_id"]
    sources = _trace_ids(db)
    assert {"cubic", "linear", "budget"} <= set(sources)
    assert sources == dict.fromkeys(sources, {newest})
    cubic = client.get("/v1/plans/arch-1", params={**QUERY, "algorithm": "cubic"}).json()
    assert cubic["trace"]["trace_id"] == newest
    frontier = client.get("/v1/plans/arch-1/frontier", params=QUERY).json()["points"]
    assert {p["trace"]["trace_id"] for p in frontier} == {newest}
    job = client.get(f"/v1/jobs/{late_job}").json()
    assert job["state"] == "succeeded"
    if late == "before the re-profile":
        assert outcomes == ["succeeded"] and job["message"] == "done: 1 plans"
    else:  # dropped, and the job says why rather than failing
        assert outcomes == ["superseded"]
        assert job["message"] == (f"superseded: trace {first['trace_id']} is no longer the newest of its key "
                                  f"(trace {newest} is); its 1 plans were dropped, not stored")
        assert job["result"]["superseded_by"] == newest and job["result"]["plans"] == []


def _store(db: Database, trace: Trace, plans: list[Plan]) -> int:
    with db.write_session() as session:
        stored = repository.store_trace(session=session, trace=trace)
        repository.store_plans(session=session, trace_id=stored.trace_id, plans=plans)
    return stored.trace_id


def _frontier(trace: Trace, *budgets: int) -> list[Plan]:
    return [p for b in budgets for p in fixed_plans(trace, ["budget"], budget_bytes=b)]


def test_a_superseded_trace_writes_nothing_through_the_repository(db: Database) -> None:
    """The same through the repository, frontier points included: the late write changes no row, and an older
    trace's content uploaded again does not bring its plans back."""
    old, new = make_trace(scale=1), make_trace(scale=2)
    old_id = _store(db, old, fixed_plans(old, ["linear", "none"]) + _frontier(old, 6000, 7000))
    new_id = _store(db, new, fixed_plans(new, ["linear", "none", "cubic"]) + _frontier(new, 5000))
    with db.write_session() as session:
        late = repository.store_plans(session=session, trace_id=old_id,
                                      plans=fixed_plans(old, ["cubic"]) + _frontier(old, 4000))
        again = repository.store_profile(session=session, trace=old, plans=fixed_plans(old, ["linear"]),
                                         measurements={})
    assert late is not None and late.superseded_by == new_id
    assert again.trace_id == old_id and again.superseded_by == new_id
    assert _trace_ids(db)["cubic"] == _trace_ids(db)["linear"] == {new_id}
    with db.read_session() as session:
        frontier = repository.find_frontier(session=session, key=KEY)
        complete = repository.newest_complete(repository.find_plans(session=session, key=KEY))
    assert [(p.trace.trace_id, p.plan.budget_bytes) for p in frontier] == [(new_id, 5000)]
    assert complete is None  # unmeasured: the newest trace's plans alone decide, never the old one's


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
@pytest.mark.parametrize("first", ["late write", "re-profile"])
def test_a_late_write_racing_a_re_profile_cannot_slip_in(db: Database, first: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """On PostgreSQL the late write and the re-profile run at once: whichever checks "newest" first is stopped
    right after its check, and the other runs until it finishes or waits on the key's lock. Without the lock,
    the late write checks before the re-profile commits and overwrites its ``cubic`` after."""
    old, new = make_trace(scale=1), make_trace(scale=2)
    old_id = _store(db, old, fixed_plans(old, ["linear", "none"]))

    def late_write(session: Session) -> Any:
        return repository.store_plans(session=session, trace_id=old_id, plans=fixed_plans(old, ["cubic"]))

    def re_profile(session: Session) -> Any:
        stored = repository.store_trace(session=session, trace=new)
        repository.store_plans(session=session, trace_id=stored.trace_id,
                               plans=fixed_plans(new, ["linear", "none", "cubic"]))
        return stored.trace_id

    after_check = Stop()
    newest_trace_id = repository._newest_trace_id
    stopping: list[threading.Thread] = []

    def stop_after_check(session: Session, **kwargs: Any) -> int:
        found = newest_trace_id(session, **kwargs)
        if threading.current_thread() in stopping:
            after_check()
        return found

    monkeypatch.setattr(repository, "_newest_trace_id", stop_after_check)
    sides = {"late write": Side(db, late_write), "re-profile": Side(db, re_profile)}
    stopped, other = sides[first], sides["re-profile" if first == "late write" else "late write"]
    stopping.append(stopped)
    stopped.start()
    assert after_check.reached.wait(60)
    other.start()
    finished_or_blocked(db, other)
    after_check.go.set()
    results = {name: side.result() for name, side in sides.items()}
    new_id = results["re-profile"]
    assert _trace_ids(db) == {"cubic": {new_id}, "linear": {new_id}, "none": {new_id}}
