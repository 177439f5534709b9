"""One job vocabulary: remat.client.job_state.JobState, which the schemas, the table and the records derive from."""

from __future__ import annotations

import typing
from datetime import UTC, datetime
from pathlib import Path

import pytest

from remat.client.job_state import ACTIVE_JOB_STATES, FINISHED_JOB_STATES, JobState
from remat.service.records import JobRecord

ROOT = Path(__file__).resolve().parents[2]


def test_active_and_finished_split_every_state() -> None:
    assert set(ACTIVE_JOB_STATES) | set(FINISHED_JOB_STATES) == set(JobState)
    assert not set(ACTIVE_JOB_STATES) & set(FINISHED_JOB_STATES)


def test_the_api_schemas_accept_exactly_the_states() -> None:
    from remat.service.schemas import JobOut, JobStateName, ZooModelOut

    assert set(typing.get_args(JobStateName)) == {state.value for state in JobState}
    for model in (JobOut, ZooModelOut):
        assert set(model.model_json_schema()["properties"]["state"]["enum"]) == {state.value for state in JobState}


@pytest.mark.parametrize("state", list(JobState))
def test_a_record_reads_a_stored_state_and_writes_its_plain_spelling(state: JobState) -> None:
    now = datetime.now(UTC)
    record = JobRecord(id="j", state=state.value, progress=0.0, message=None, error=None, request={}, result=None,
                       created_at=now, updated_at=now, started_at=None, finished_at=None)
    assert record.state is state and record.finished == (state in FINISHED_JOB_STATES)
    assert type(record.to_dict()["state"]) is str and record.to_dict()["state"] == state.value


def test_a_misspelt_state_is_refused() -> None:
    now = datetime.now(UTC)
    with pytest.raises(ValueError, match="done"):
        JobRecord(id="j", state="done", progress=0.0, message=None, error=None, request={}, result=None,
                  created_at=now, updated_at=now, started_at=None, finished_at=None)


def test_the_partial_index_names_the_active_states_as_the_migration_does() -> None:
    from remat.service.models import JobRow

    [index] = [i for i in JobRow.__table__.indexes if i.name == "uq_jobs_active_request"]
    where = str(index.dialect_options["postgresql"]["where"])
    assert where in (ROOT / "migrations" / "versions" / "0003_workers.py").read_text()
    assert all(f"'{state}'" in where for state in ACTIVE_JOB_STATES)
