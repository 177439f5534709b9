"""Job liveness: every job, created however its leader's end interleaves with it, reaches a terminal state.

A follower is never sent to a worker; only its leader's end (or the reaper) ends it. On PostgreSQL the
leader can end between a submission's read of it and the follower's commit (NOTE [follower lock] in
service/jobs.py); the interleavings are forced with events (tests/service/interleave.py), never sleeps. Each
scenario then plays the workers (every leader claimed and finished) and one reaper pass, and every job must
have ended: nothing waits past the reaper's period.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from remat.client.job_state import FINISHED_JOB_STATES
from remat.service import jobs
from remat.service.config import ServiceSettings
from remat.service.db import Database
from remat.service.models import JobRow, utcnow
from remat.service.records import JobRecord
from tests.service.interleave import Side, Stop, finished_or_blocked

REQUEST = {"model": "resnet18", "batch_size": 2}
KEY = "req-live"
RESULT = {"plans": 7}
on_postgresql = pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)


def _all_jobs(db: Database) -> list[JobRecord]:
    with db.read_session() as session:
        return jobs.list_jobs(session=session, limit=200)[0]


def _stranded(db: Database) -> list[JobRecord]:
    """Unfinished followers of a finished leader: what nothing but the reaper would ever end."""
    by_id = {job.id: job for job in _all_jobs(db)}
    return [job for job in by_id.values() if job.leader_id is not None and not job.finished
            and by_id[job.leader_id].finished]


def _leading_job(db: Database) -> JobRecord:
    """A leader running on w1, whose lease has just lapsed: w1 may still finish it, a claim may give up on it."""
    with db.write_session() as session:
        leader, _ = jobs.create_job(session=session, request=REQUEST, request_key=KEY)
        claim = jobs.claim_job(session=session, job_id=leader.id, owner="w1", lease_s=-1, max_attempts=3)
    assert claim.outcome == "run"
    return leader


def _play_to_the_end(db: Database) -> list[JobRecord]:
    """What the cluster does next: a worker runs every leader still active, then one reaper pass."""
    for job in _all_jobs(db):
        if job.leader_id is None and not job.finished:
            with db.write_session() as session:
                assert jobs.claim_job(session=session, job_id=job.id, owner="w2", lease_s=60,
                                      max_attempts=3).outcome == "run"
                assert jobs.finish_job(session=session, job_id=job.id, owner="w2", state="succeeded", result=RESULT)
    period = ServiceSettings().reap_interval_s
    with db.write_session() as session:
        jobs.reap_jobs(session=session, requeue_after_s=period, pending_after_s=period,
                       now=utcnow() + timedelta(seconds=period))
    return _all_jobs(db)


def _finish_leader(leader_id: str) -> Callable[[Session], Any]:
    def body(session: Session) -> bool:
        return jobs.finish_job(session=session, job_id=leader_id, owner="w1", state="succeeded", result=RESULT)
    return body


def _give_up_on_leader(leader_id: str) -> Callable[[Session], Any]:
    """The other way a leader ends: a claim that finds it has used up its attempts."""
    def body(session: Session) -> str:
        return jobs.claim_job(session=session, job_id=leader_id, owner="w9", lease_s=60, max_attempts=1).outcome
    return body


def _submit(session: Session) -> tuple[JobRecord, bool]:
    return jobs.create_job(session=session, request=REQUEST, request_key=KEY)


@on_postgresql
@pytest.mark.parametrize("ending", [_finish_leader, _give_up_on_leader])
def test_a_submission_while_its_leader_ends_is_never_stranded(
        db: Database, ending: Callable[[str], Callable[[Session], Any]]) -> None:
    """The leader's end is written but not committed when the submission reads it: the submission must wait
    for that commit and lead, not follow a leader that will never finish it."""
    leader = _leading_job(db)
    before_commit = Stop()
    ender_body = ending(leader.id)
    ender = Side(db, lambda session: (ender_body(session), before_commit())[0])
    ender.start()
    assert before_commit.reached.wait(60)
    submission = Side(db, _submit)
    submission.start()
    finished_or_blocked(db, submission)  # the fixed code waits on the leader's row; the old one follows it
    before_commit.go.set()
    ender.result()
    job, must_send = submission.result()
    assert _stranded(db) == [], "a follower of a finished leader: nothing would ever end it"
    assert job.leader_id is None and must_send  # it leads its own run
    assert all(j.state in FINISHED_JOB_STATES for j in _play_to_the_end(db))


@on_postgresql
@pytest.mark.parametrize("ending", [_finish_leader, _give_up_on_leader])
def test_a_leader_ending_right_after_a_submission_read_it_ends_the_follower(
        db: Database, ending: Callable[[str], Callable[[Session], Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The submission has read the active leader and not committed its follower when the leader ends: the end
    must wait for that commit and take the follower with it."""
    leader = _leading_job(db)
    after_read = Stop()
    read_leader = jobs._active_leader
    submitting: list[threading.Thread] = []

    def stop_after_read(session: Session, request_key: str) -> JobRow | None:
        row = read_leader(session, request_key)
        if threading.current_thread() in submitting:
            after_read()
        return row

    monkeypatch.setattr(jobs, "_active_leader", stop_after_read)
    submission = Side(db, _submit)
    submitting.append(submission)
    submission.start()
    assert after_read.reached.wait(60)
    ender = Side(db, ending(leader.id))
    ender.start()
    finished_or_blocked(db, ender)  # the fixed code waits for the follower's commit; the old one ends without it
    after_read.go.set()
    follower, must_send = submission.result()
    ender.result()
    assert follower.leader_id == leader.id and not must_send
    assert _stranded(db) == [], "a follower of a finished leader: nothing would ever end it"
    with db.read_session() as session:
        ended = jobs.get_job(session=session, job_id=follower.id)
        ended_leader = jobs.get_job(session=session, job_id=leader.id)
    assert ended is not None and ended_leader is not None
    assert (ended.state, ended.error, ended.result) == (ended_leader.state, ended_leader.error, ended_leader.result)
    assert all(j.state in FINISHED_JOB_STATES for j in _play_to_the_end(db))


def test_the_reaper_ends_followers_whose_leader_ended_or_is_gone(db: Database) -> None:
    """Defence in depth: however a follower outlived its leader, one reaper pass ends it as the leader ended."""
    leader = _leading_job(db)
    with db.write_session() as session:
        follower, _ = _submit(session)
        live_leader, _ = jobs.create_job(session=session, request=REQUEST, request_key="other")
        live_follower, _ = jobs.create_job(session=session, request=REQUEST, request_key="other")
        orphan = JobRow(id=str(uuid.uuid4()), kind="profile", request=REQUEST, request_key="gone", state="queued",
                        leader_id=str(uuid.uuid4()), created_at=utcnow(), updated_at=utcnow(), progress=0.0)
        session.add(orphan)
    with db.write_session() as session:  # the leader ends without seeing its follower (the lost race's outcome)
        session.execute(update(JobRow).where(JobRow.id == leader.id).values(
            state="failed", error="out of memory", message="failed", finished_at=utcnow(), lease_owner=None))
    period = ServiceSettings().reap_interval_s
    with db.write_session() as session:
        sent = jobs.reap_jobs(session=session, requeue_after_s=period, pending_after_s=period, now=utcnow())
    assert sent == []  # followers are ended, never sent
    with db.read_session() as session:
        states = {row.id: row for row in session.execute(select(JobRow)).scalars()}
    assert (states[follower.id].state, states[follower.id].error) == ("failed", "out of memory")
    assert states[follower.id].message == f"failed (with job {leader.id}, same request)"
    assert states[orphan.id].state == "failed" and "is gone" in (states[orphan.id].error or "")
    assert states[live_follower.id].state == "queued" and states[live_leader.id].state == "pending"
