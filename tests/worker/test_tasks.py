"""The Celery tasks' bodies, called in-process: failures end a job with a reason and write no rows."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import DataError, OperationalError

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


def _profiled(request: ModelRequest, runs: list[str]) -> Callable[..., Any]:
    """A stand-in for ``pipeline.run_built``: a small profile at once, each run counted."""
    from remat.client.report import ProfileResult
    from tests.service.factories import fixed_plans, make_trace

    def run_built(built: Any, progress: Callable[[str, float], None], certify_s: float = 0.0) -> ProfileResult:
        runs.append(request.name)
        trace = make_trace()
        return ProfileResult(request=request, key=built.key, trace=trace, plans=tuple(fixed_plans(trace)))

    return run_built


def _database_error(message: str) -> OperationalError:
    return OperationalError("INSERT INTO plans ...", {}, sqlite3.OperationalError(message))


@pytest.mark.parametrize("failures, error", [
    (1, _database_error("database is locked")),
    (4, _database_error("server closed the connection unexpectedly")),
    (1, DataError("INSERT INTO plans ...", {}, ValueError("value out of range"))),
], ids=["transient once", "transient every time", "refused"])
def test_a_database_error_at_the_final_write_retries_the_write_alone(settings: ServiceSettings,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     failures: int, error: Exception) -> None:
    """Minutes of profiling end in one write. A transient error there retries that write (bounded), never the
    profiling; when the write keeps failing, or fails for good, the job fails naming the write — it used to
    escape the task, so the lease lapsed, the reaper ran the whole job again and, after the last attempt,
    blamed a lost worker."""
    from remat.client.graph import built_model
    from remat.client.plan_key import PlanKey
    from remat.service import repository
    from tests.service.factories import make_trace

    request = ModelRequest(spec="resnet18", batch_size=1, sample_shape=(3, 32, 32))
    runs: list[str] = []
    monkeypatch.setattr(built_model, "build", lambda request: SimpleNamespace(key=PlanKey.from_trace(make_trace())))
    monkeypatch.setattr(pipeline, "run_built", _profiled(request, runs))
    monkeypatch.setattr(tasks, "FINAL_WRITE_BACKOFF_S", 0.0, raising=False)  # no waiting between attempts here
    store_profile = repository.store_profile
    writes: list[int] = []

    def failing_write(**kwargs: Any) -> Any:
        writes.append(1)
        if len(writes) <= failures:
            raise error
        return store_profile(**kwargs)

    monkeypatch.setattr(repository, "store_profile", failing_write)
    job_id = _submit(settings, request)
    outcome = tasks.profile_model(_task(settings), job_id)
    job = _job(settings, job_id)
    assert runs == [request.name]  # profiled once, whatever happened to the write
    if isinstance(error, OperationalError) and failures < tasks.FINAL_WRITE_ATTEMPTS:
        assert (outcome, job.state, len(writes)) == ("succeeded", "succeeded", failures + 1)
        assert _rows(settings) == (1, 2)
        return
    assert (outcome, job.state) == ("write failed", "failed")
    assert job.error.startswith("could not store the results in the database"), job.error
    if isinstance(error, OperationalError):  # retried to the bound, then given up with the driver's reason
        assert len(writes) == tasks.FINAL_WRITE_ATTEMPTS
        assert f"the write failed {tasks.FINAL_WRITE_ATTEMPTS} times (OperationalError: server closed" in job.error
    else:  # not transient: no retry
        assert len(writes) == 1 and "(DataError: value out of range)" in job.error
    assert "lost" not in job.error and "\n" not in job.error
    assert _rows(settings) == (0, 0)
    with tasks.plan_store(settings).db.write_session() as session:  # finished: no reaper sends it again
        assert jobs.reap_jobs(session=session, requeue_after_s=0, pending_after_s=0) == []


@pytest.mark.slow
def test_a_job_for_a_new_batch_of_a_stored_architecture_derives_instead_of_profiling(
        settings: ServiceSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    from remat.client.derived_trace import derived_sizes
    from remat.client.graph.built_model import build

    def request(batch: int) -> ModelRequest:
        return ModelRequest(spec="resnet18", batch_size=batch, sample_shape=(3, 8, 8), device="cpu")

    store = tasks.plan_store(settings)
    for batch in (2, 4):  # two stored profiles, as earlier jobs leave them
        store.save_trace(pipeline.profile(build(request(batch))))

    def no_profile(*args: object, **kwargs: object) -> None:
        raise AssertionError("profiled a batch size two stored profiles answer")

    monkeypatch.setattr(pipeline, "profile", no_profile)
    job_id = _submit(settings, request(6))
    assert tasks.profile_model(_task(settings), job_id) == "succeeded"
    job = _job(settings, job_id)
    trace = store.load_trace(job.result["trace_id"])
    assert trace is not None and derived_sizes(trace) == (2, 4) and trace.metadata["batch_size"] == 6
    measured = [e for e in job.result["plans"] if e.get("measurement")]
    assert measured and all(e["measurement"]["measured_peak_bytes"] is not None for e in measured)


@pytest.mark.slow
def test_a_job_for_a_new_sequence_length_of_a_stored_token_model_derives_instead_of_profiling(
        settings: ServiceSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    from remat.client.derived_trace import derived_along, derived_sizes
    from remat.client.graph.built_model import build

    def request(seq_len: int) -> ModelRequest:
        return ModelRequest(spec="hf:gpt2", batch_size=2, sample_shape=(seq_len,), seq_len=seq_len, device="cpu",
                            model_kwargs={"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 512})

    store = tasks.plan_store(settings)
    for seq_len in (8, 16, 24):  # three stored lengths, as earlier jobs leave them: attention holds its scores
        store.save_trace(pipeline.profile(build(request(seq_len))))

    def no_profile(*args: object, **kwargs: object) -> None:
        raise AssertionError("profiled a sequence length three stored profiles answer")

    monkeypatch.setattr(pipeline, "profile", no_profile)
    job_id = _submit(settings, request(40))
    assert tasks.profile_model(_task(settings), job_id) == "succeeded"
    trace = store.load_trace(_job(settings, job_id).result["trace_id"])
    assert trace is not None and derived_along(trace) == "seq_len" and derived_sizes(trace) == (8, 16, 24)
    assert trace.metadata["input_shape"] == [2, 40]
