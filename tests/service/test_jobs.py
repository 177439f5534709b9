"""The job table's state machine (service/jobs.py) on SQLite and PostgreSQL: dedup, leases, finish, reaping."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from remat.service import jobs
from remat.service.db import Database
from remat.service.models import utcnow
from remat.service.records import JobRecord

REQUEST = {"model": "resnet18", "batch_size": 2}


def _create(db: Database, key: str | None = "req-1", **kwargs: object) -> tuple[JobRecord, bool]:
    with db.write_session() as session:
        return jobs.create_job(session=session, request=REQUEST, request_key=key, **kwargs)  # type: ignore[arg-type]


def _claim(db: Database, job_id: str, owner: str = "w1", lease_s: float = 30.0,
           max_attempts: int = 3) -> jobs.Claim:
    with db.write_session() as session:
        return jobs.claim_job(session=session, job_id=job_id, owner=owner, lease_s=lease_s, max_attempts=max_attempts)


def _get(db: Database, job_id: str) -> JobRecord:
    with db.read_session() as session:
        job = jobs.get_job(session=session, job_id=job_id)
    assert job is not None
    return job


def test_lifecycle_and_conditional_updates(db: Database) -> None:
    job, must_enqueue = _create(db, queue="cpu")
    assert must_enqueue and job.state == "pending" and job.queue == "cpu" and job.attempts == 0
    with db.write_session() as session:
        queued = jobs.update_job(session=session, job_id=job.id, state="queued", only_from=("pending",), enqueued=True)
    assert queued is not None and queued.state == "queued"
    claim = _claim(db, job.id)
    assert claim.outcome == "run" and claim.job is not None and claim.job.attempts == 1
    assert claim.job.started_at is not None and claim.job.lease_owner == "w1"
    with db.write_session() as session:  # a late "queued" from the API must not undo "running"
        late = jobs.update_job(session=session, job_id=job.id, state="queued", only_from=("pending",))
    assert late is not None and late.state == "running"
    with db.write_session() as session:
        assert jobs.heartbeat(session=session, job_id=job.id, owner="w1", lease_s=30, progress=0.5,
                              message="profiling", plan_key={"model_hash": "abc"})
        assert not jobs.heartbeat(session=session, job_id=job.id, owner="someone-else", lease_s=30)
    assert _get(db, job.id).progress == 0.5 and _get(db, job.id).plan_key == {"model_hash": "abc"}
    with db.write_session() as session:
        assert not jobs.finish_job(session=session, job_id=job.id, owner="someone-else", state="succeeded")
        assert jobs.finish_job(session=session, job_id=job.id, owner="w1", state="succeeded", result={"plans": 6})
    done = _get(db, job.id)
    assert done.state == "succeeded" and done.finished and done.progress == 1.0 and done.result == {"plans": 6}
    assert done.lease_owner is None and done.finished_at is not None
    assert _claim(db, job.id).outcome == "finished"
    with pytest.raises(ValueError, match="state"):
        with db.write_session() as session:
            jobs.update_job(session=session, job_id=job.id, state="exploded")
    assert _claim(db, "00000000-0000-4000-8000-000000000000").outcome == "missing"


def test_a_second_submission_of_an_active_request_follows_the_first(db: Database) -> None:
    leader, enqueue_leader = _create(db)
    follower, enqueue_follower = _create(db)
    assert enqueue_leader and not enqueue_follower
    assert follower.leader_id == leader.id and follower.state == "queued" and leader.id in (follower.message or "")
    other, enqueue_other = _create(db, key="req-2")
    assert enqueue_other and other.leader_id is None
    assert _claim(db, follower.id).outcome == "follower"
    assert _claim(db, leader.id).outcome == "run"
    with db.write_session() as session:
        jobs.finish_job(session=session, job_id=leader.id, owner="w1", state="failed", error="out of memory")
    followed = _get(db, follower.id)
    assert followed.state == "failed" and followed.error == "out of memory" and followed.finished_at is not None
    again, enqueue_again = _create(db)  # the leader finished: a new submission runs again
    assert enqueue_again and again.leader_id is None


def test_concurrent_first_submissions_elect_one_leader(db: Database) -> None:
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda _: _create(db, key="same"), range(8)))
    leaders = [job for job, enqueue in results if enqueue]
    assert len(leaders) == 1
    assert all(job.leader_id == leaders[0].id for job, enqueue in results if not enqueue)


def test_a_live_lease_is_busy_a_lapsed_one_is_taken_over(db: Database) -> None:
    job, _ = _create(db)
    assert _claim(db, job.id, owner="w1", lease_s=60).outcome == "run"
    busy = _claim(db, job.id, owner="w2")
    assert busy.outcome == "busy" and 0 < busy.retry_after_s <= 60
    assert _claim(db, job.id, owner="w1", lease_s=-1).outcome == "run"  # the owner may re-claim (a redelivery)
    taken = _claim(db, job.id, owner="w2")  # w1's lease has lapsed
    assert taken.outcome == "run" and taken.job is not None and taken.job.attempts == 3
    with db.write_session() as session:  # w1 comes back: its write is refused
        assert not jobs.finish_job(session=session, job_id=job.id, owner="w1", state="succeeded")
    assert _get(db, job.id).state == "running"


def test_a_job_whose_worker_keeps_dying_gives_up(db: Database) -> None:
    job, _ = _create(db)
    for attempt in range(2):
        assert _claim(db, job.id, owner=f"w{attempt}", lease_s=-1, max_attempts=2).outcome == "run"
    gave_up = _claim(db, job.id, owner="w9", max_attempts=2)
    assert gave_up.outcome == "gave_up"
    failed = _get(db, job.id)
    assert failed.state == "failed" and "lost 2 times" in (failed.error or "")


def test_reaper_requeues_lapsed_leases_and_forgotten_jobs_once(db: Database) -> None:
    running, _ = _create(db, key="a")
    _claim(db, running.id, lease_s=-1)
    forgotten, _ = _create(db, key="b")  # pending: the API stopped before enqueueing it
    fresh, _ = _create(db, key="c")
    follower, _ = _create(db, key="b")
    later = utcnow() + timedelta(seconds=100)
    with db.write_session() as session:
        jobs.update_job(session=session, job_id=fresh.id, state="queued", enqueued=True)
    with db.write_session() as session:
        reaped = jobs.reap_jobs(session=session, requeue_after_s=50, pending_after_s=50, now=later)
    assert {job.id for job in reaped} == {running.id, forgotten.id, fresh.id}
    assert all(job.state == "queued" and job.lease_owner is None for job in reaped)
    with db.write_session() as session:  # just re-enqueued: not again
        assert jobs.reap_jobs(session=session, requeue_after_s=50, pending_after_s=50, now=later) == []
    assert _get(db, follower.id).leader_id == forgotten.id


def test_release_gives_the_lease_back_for_a_retry(db: Database) -> None:
    job, _ = _create(db)
    _claim(db, job.id, owner="w1")
    with db.write_session() as session:
        assert not jobs.release_job(session=session, job_id=job.id, owner="w2", message="x")
        assert jobs.release_job(session=session, job_id=job.id, owner="w1", message="database busy; retrying")
    released = _get(db, job.id)
    assert released.state == "queued" and released.lease_owner is None
    assert _claim(db, job.id, owner="w2").outcome == "run"


def test_list_jobs_pages_newest_first(db: Database) -> None:
    created = [_create(db, key=None)[0] for _ in range(3)]
    with db.read_session() as session:
        page, total = jobs.list_jobs(session=session, limit=2)
        pending, _ = jobs.list_jobs(session=session, state="pending")
    assert total == 3 and len(page) == 2 and len(pending) == 3
    assert {job.id for job in page} <= {job.id for job in created}


def test_record_send_queues_on_success_and_waits_for_the_broker_on_failure(db: Database) -> None:
    sent, _ = _create(db, key="s")
    refused, _ = _create(db, key="r")
    running, _ = _create(db, key="w")
    _claim(db, running.id)
    with db.write_session() as session:
        assert jobs.record_send(session=session, job_id=sent.id, queue="cpu", error=None).state == "queued"
        waiting = jobs.record_send(session=session, job_id=refused.id, queue="cpu", error="broker down")
        assert waiting.state == "pending" and waiting.message == "waiting for the broker (broker down)"
        # a reaper marked it queued, then the broker refused it: back to pending
        jobs.update_job(session=session, job_id=sent.id, state="queued")
        assert jobs.record_send(session=session, job_id=sent.id, queue="cpu", error="down").state == "pending"
        # a worker already runs it: nothing changes
        assert jobs.record_send(session=session, job_id=running.id, queue="cpu", error="down").state == "running"
        assert jobs.record_send(session=session, job_id=running.id, queue="cpu", error=None).state == "running"
