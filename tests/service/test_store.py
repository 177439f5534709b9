"""PlanStore, the CLI's embedded entry point: default location, first-use migration, the round trip."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import redis

from remat.client.plan import Plan
from remat.client.plan_key import UNKNOWN, PlanKey
from remat.service.cache import PlanCache
from remat.service.config import ServiceSettings, default_database_url
from remat.service.records import Measurement
from remat.service.store import PlanStore
from tests.service.factories import REDIS_URL, fixed_plans, make_trace


def test_default_database_is_a_sqlite_file_in_the_user_cache(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    monkeypatch.delenv("REMAT_DATABASE_URL", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_database_url() == f"sqlite:///{tmp_path / 'cache' / 'remat' / 'remat.sqlite'}"
    with PlanStore() as store:
        assert store.url == default_database_url()
        assert store.find_plans(PlanKey.from_trace(make_trace())) is None
    assert (tmp_path / "cache" / "remat" / "remat.sqlite").is_file()


def test_environment_overrides_the_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("REMAT_DATABASE_URL", f"sqlite:///{tmp_path / 'elsewhere.sqlite'}")
    assert PlanStore().url.endswith("elsewhere.sqlite")
    monkeypatch.setenv("REMAT_DATABASE_URL", "postgresql://user@db:5432/remat")
    assert ServiceSettings().database_url == "postgresql+psycopg://user@db:5432/remat"


def test_save_find_measure(db_url: str) -> None:
    trace = make_trace()
    with PlanStore(db_url) as store:
        key = store.save_trace_and_plans(trace, fixed_plans(trace))
        assert key == PlanKey.from_trace(trace)
        plans = store.find_plans(key)
        assert plans is not None and [p.algorithm for p in plans] == ["linear", "none"]
        assert all(isinstance(p, Plan) for p in plans)
        stored = store.save_measurement(key, Measurement(measured_peak_bytes=77, step_ms=3.0))
        assert stored is not None and stored.checkpoints == (2,)
        assert store.save_measurement(key, Measurement(), algorithm="cubic") is None
        record = store.get_plan(key)
        assert record is not None and record.measurements[0].measured_peak_bytes == 77
        assert store.load_trace(record.trace.trace_id) == trace
        job = store.create_job({"model": "resnet18"})
        assert store.update_job(job.id, state="running") is not None
        assert store.get_job(job.id) is not None and store.get_job(job.id).state == "running"  # type: ignore[union-attr]


def test_writers_can_invalidate_the_service_cache(sqlite_url: str, redis_prefix: str) -> None:
    trace = make_trace()
    settings = ServiceSettings(database_url=sqlite_url, redis_url=REDIS_URL, cache_prefix=redis_prefix)
    client = redis.Redis.from_url(REDIS_URL)
    with PlanStore(settings=settings, use_cache=True) as store:
        key = PlanKey.from_trace(trace)
        # The names the API reads under: this torch version, and "any version" (unknown).
        names = [PlanCache(settings).key_name(k, "linear", None)
                 for k in (key, dataclasses.replace(key, torch_version=UNKNOWN))]
        assert len(set(names)) == 2 and all(n.startswith(f"{redis_prefix}plan:") for n in names)
        for name in names:
            client.set(name, b"{}")
        store.save_trace_and_plans(trace, fixed_plans(trace))
        assert [client.get(name) for name in names] == [None, None]
        for name in names:
            client.set(name, b"{}")
        store.save_measurement(key, Measurement(measured_peak_bytes=1))
        assert [client.get(name) for name in names] == [None, None]
    client.close()
