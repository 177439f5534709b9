"""The Celery tasks' bodies, called in-process: failures end a job with a reason and write no rows."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import func, select

from remat.client.request import ModelRequest
from remat.service import jobs
from remat.service.config import ServiceSettings
from remat.service.models import PlanRow, TraceRow
from remat.worker import pipeline, profilers, tasks


@pytest.fixture
def settings(tmp_path: Path) -> ServiceSettings:
    return ServiceSettings(database_url=f"sqlite:///{tmp_path / 'jobs.sqlite'}", redis_url=None)


def _task(settings: ServiceSettings) -> Any:
    return SimpleNamespace(app=SimpleNamespace(remat_settings=settings), request=SimpleNamespace(retries=0))


def _submit(settings: ServiceSettings, request: ModelRequest) -> str:
    store = tasks.plan_store(settings)
    with store.db.write_session() as session:
        job, _ = jobs.create_job(session=session, request=request.to_dict(), request_key=request.fingerprint,
                                 queue="cpu")
    return job.id


def _rows(settings: ServiceSettings) -> tuple[int, int]:
    with tasks.plan_store(settings).db.read_session() as session:
        return (session.execute(select(func.count()).select_from(TraceRow)).scalar_one(),
                session.execute(select(func.count()).select_from(PlanRow)).scalar_one())


def _job(settings: ServiceSettings, job_id: str) -> Any:
    with tasks.plan_store(settings).db.read_session() as session:
        return jobs.get_job(session=session, job_id=job_id)


@pytest.mark.parametrize("request_", [
    ModelRequest(spec="os:system", batch_size=1, sample_shape=(3,), model_kwargs={"command": "touch /tmp/pwned"}),
    ModelRequest(spec="resnet18", batch_size=1, sample_shape=(3, 8, 8), model_kwargs={"num_classes": 3}),
])
def test_a_job_row_naming_a_callable_is_refused_without_importing_it(settings: ServiceSettings,
                                                                    request_: ModelRequest,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import remat.client.model_spec as model_spec

    monkeypatch.setattr(model_spec, "_import_callable", lambda spec: pytest.fail(f"imported {spec}"))
    job_id = _submit(settings, request_)  # as if written to the database by something other than the API
    assert tasks.profile_model(_task(settings), job_id) == "failed"
    assert ("workers build torchvision models with their default arguments, and hf: models of the allow-list, "
            "only") in _job(settings, job_id).error
    assert _rows(settings) == (0, 0)


def test_a_model_that_cannot_run_at_the_input_fails_with_the_reason(settings: ServiceSettings) -> None:
    job_id = _submit(settings, ModelRequest(spec="inception_v3", batch_size=2, sample_shape=(3, 32, 32)))
    assert tasks.profile_model(_task(settings), job_id) == "failed"
    job = _job(settings, job_id)
    assert job.state == "failed"
    assert job.error.startswith("Inception3 does not run on input [2, 3, 32, 32]: RuntimeError: "
                                "Calculated padded input size")
    assert job.error.endswith("use --input-shape 3,299,299"), job.error
    assert "Traceback" not in job.error and "\n" not in job.error
    assert _rows(settings) == (0, 0)


def test_out_of_memory_fails_with_what_to_try(settings: ServiceSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    def exhausted(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(profilers, "profile", exhausted)  # the profiler itself runs out
    job_id = _submit(settings, ModelRequest(spec="resnet18", batch_size=2, sample_shape=(3, 32, 32)))
    assert tasks.profile_model(_task(settings), job_id) == "failed"
    job = _job(settings, job_id)
    assert job.error == ("out of memory profiling torchvision:resnet18 at batch 2 on cpu: use a smaller batch or "
                         "input, or a device with more memory")
    assert job.plan_key is not None  # the model was built: the key was recorded before profiling
    assert _rows(settings) == (0, 0)


def test_an_unexpected_error_is_one_line_and_not_a_traceback(settings: ServiceSettings,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise KeyError("stage 7\nsecond line")

    monkeypatch.setattr(pipeline, "profile", broken)
    job_id = _submit(settings, ModelRequest(spec="resnet18", batch_size=2, sample_shape=(3, 32, 32)))
    tasks.profile_model(_task(settings), job_id)
    job = _job(settings, job_id)
    assert job.state == "failed" and job.error.startswith("internal error (KeyError: "), job.error
    assert "\n" not in job.error


def test_a_job_claimed_by_a_live_worker_is_left_to_it(settings: ServiceSettings) -> None:
    job_id = _submit(settings, ModelRequest(spec="resnet18", batch_size=1, sample_shape=(3, 32, 32)))
    with tasks.plan_store(settings).db.write_session() as session:
        jobs.claim_job(session=session, job_id=job_id, owner="elsewhere:1", lease_s=60, max_attempts=3)
    assert tasks.profile_model(_task(settings), job_id) == "busy"
    assert _job(settings, job_id).lease_owner == "elsewhere:1"
