"""The web pages' reads, on SQLite and PostgreSQL: a page of keys with their best plan, searched and counted; jobs
and zoo batches newest first without a count of the table; a trace's stages a page at a time; and the version a
key's pictures are cached under."""

from __future__ import annotations

from sqlalchemy import update

from remat.client.job_state import JobState
from remat.client.measurement import Measurement
from remat.client.planning.planners import PLANNERS
from remat.client.report import Trade
from remat.service import jobs, repository, zoo
from remat.service.db import Database
from remat.service.models import PlanRow
from tests.utils.ui_seed import architecture_hash, seed_jobs, seed_keys


def test_a_page_of_keys_newest_first_with_their_best_plan(db: Database) -> None:
    seeded = seed_keys(db, 3, stages=(12,), names=["torchvision:resnet50", "hf:gpt2", "100%_sure"])
    with db.read_session() as session:
        page, total = repository.key_summaries(session=session, limit=2)
        rest, _ = repository.key_summaries(session=session, limit=2, offset=2)
    assert total == 3 and len(page) == 2 and len(rest) == 1
    assert [s.key for s in [*page, *rest]] == list(reversed(seeded.keys))  # newest planned first
    summary = page[0]
    assert summary.model == "100%_sure" and summary.num_stages == 12
    assert {row.plan.algorithm for row in summary.rows} == set(PLANNERS)  # no frontier point among them
    assert all(row.measured_peak_bytes is not None and row.timeline is None for row in summary.rows)
    best = summary.best
    assert best is not None and best.plan.algorithm != "none"
    assert best.measured_peak_bytes == min(r.measured_peak_bytes for r in summary.rows if r.plan.algorithm != "none")
    assert summary.trade == Trade.of(summary.baseline, best)
    assert summary.trade.saving is not None and 0 < summary.trade.saving < 1


def test_keys_are_searched_by_name_or_hash_prefix_literally(db: Database) -> None:
    seed_keys(db, 3, stages=(12,), names=["torchvision:resnet50", "hf:gpt2", "100%_sure"])

    def found(search: str) -> list[str | None]:
        with db.read_session() as session:
            page, total = repository.key_summaries(session=session, search=search)
        assert total == len(page)
        return [s.model for s in page]

    assert found("ResNet") == ["torchvision:resnet50"]
    assert found(architecture_hash(1)[:6]) == ["hf:gpt2"]
    assert found("0%_") == ["100%_sure"]
    assert found("0_") == [] and found("r%t") == []


def test_a_key_of_several_torch_versions_is_a_row_each(db: Database) -> None:
    seeded = seed_keys(db, 1, stages=(12,))
    with db.write_session() as session:  # the same architecture and input planned under another torch
        session.execute(update(PlanRow).values(torch_version="1.9"))
    seed_keys(db, 1, stages=(12,))
    with db.read_session() as session:
        page, total = repository.key_summaries(session=session)
    assert total == 2 and {s.key.torch_version for s in page} == {"1.9", seeded.keys[0].torch_version}
    assert all(len(s.rows) == len(PLANNERS) for s in page)


def test_a_traces_stages_a_page_at_a_time(db: Database) -> None:
    key = seed_keys(db, 1, stages=(30,)).keys[0]
    with db.read_session() as session:
        trace_id = repository.get_plan(session=session, key=key, algorithm="none").trace.trace_id
        stages = repository.trace_stages(session=session, trace_id=trace_id, limit=20, offset=20)
    assert [s.name for s in stages] == [f"features.{i}.block" for i in range(21, 31)]
    assert stages[0].forward_ms is not None and stages[0].output_bytes > 0


def test_a_keys_version_changes_with_its_plans_and_measurements(db: Database) -> None:
    key = seed_keys(db, 1, stages=(12,)).keys[0]

    def version() -> tuple[object, ...]:
        with db.read_session() as session:
            return repository.key_version(session=session, key=key)

    first = version()
    assert first[0] > len(PLANNERS)  # the plans and the frontier's points
    with db.write_session() as session:
        repository.store_measurement(session=session, key=key, algorithm="linear",
                                     measurement=Measurement(measured_peak_bytes=1, step_ms=1.0))
    second = version()
    assert second != first
    seed_keys(db, 1, stages=(12,))  # a new profile of the same key replaces its plans
    assert version() != second
    with db.read_session() as session:
        other = repository.key_version(session=session, key=key.__class__(**{**key.to_dict(), "dtype": "float16"}))
    assert other[0] == 0


def test_jobs_and_batches_newest_first_without_counting_the_table(db: Database) -> None:
    seed_jobs(db)
    with db.read_session() as session:
        page, more = jobs.recent_jobs(session=session, limit=3)
        rest, no_more = jobs.recent_jobs(session=session, limit=50, offset=3)
        failed, _ = jobs.recent_jobs(session=session, state=JobState.FAILED)
        batches, more_batches = zoo.recent_batches(session=session)
    assert len(page) == 3 and more and not no_more and len(page) + len(rest) == 8
    assert all(job.result is None for job in [*page, *rest])  # results are left unread
    assert [job.created_at for job in [*page, *rest]] == sorted((j.created_at for j in [*page, *rest]), reverse=True)
    assert {job.state for job in failed} == {JobState.FAILED} and len(failed) == 2
    assert len(batches) == 1 and not more_batches
    batch = batches[0]
    assert batch.total == 4 and batch.finished == 2 and not batch.done
    assert batch.counts["succeeded"] == batch.counts["failed"] == batch.counts["running"] == 1
