"""The profiling service end to end, with real processes: a private Redis, PostgreSQL, ``remat-service`` on
loopback and ``remat-worker`` subprocesses that the tests SIGKILL.

Short leases (``REMAT_JOB_LEASE_S``) and reaper intervals make recovery take seconds instead of a minute;
the mechanism is the same as in production. Each test profiles a different request, so that their plans
never answer for one another.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from remat.client.planning.planners import PLANNERS
from remat.service import migrate
from remat.service.db import Database
from remat.service.models import JobRow, MeasurementRow, PlanRow, TraceRow
from tests.conftest import require_service

TOKEN = "e2e-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SRC = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(condition: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


@dataclass
class PrivateRedis:
    """A redis-server of our own, so that a test can stop it without disturbing anything else."""

    port: int
    workdir: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        require_service("redis-server binary", binary is not None, "redis-server is not on PATH")
        assert binary is not None
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--maxmemory-policy", "noeviction"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for(self._answers, 10, "redis-server to start")

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(10)
            self.process = None


@dataclass
class Cluster:
    """What a deployment runs: database, broker and the service; workers are started by each test."""

    env: dict[str, str]
    redis: PrivateRedis
    base_url: str
    db: Database
    logs: Path
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start_worker(self, name: str, queues: str = "cpu", **env: str) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"worker-{name}-{len(self.workers)}.log", "wb")  # noqa: SIM115 - closed by the OS
        process = subprocess.Popen(
            [sys.executable, "-m", "remat.worker.cli", "--queues", queues, "--concurrency", "1",
             "--hostname", f"{name}@e2e", "--loglevel", "info"],
            env={**self.env, **env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=SRC)
        self.workers.append(process)
        log_path = Path(log.name)
        _wait_for(lambda: b"ready." in log_path.read_bytes() or process.poll() is not None, 60,
                  f"worker {name} to start")
        assert process.poll() is None, log_path.read_text()
        return process

    def kill_workers(self) -> None:
        for process in self.workers:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        self.workers.clear()

    def submit(self, request: dict[str, Any]) -> dict[str, Any]:
        response = httpx.post(f"{self.base_url}/v1/jobs", json=request, headers=AUTH, timeout=60)
        assert response.status_code == 202, response.text
        return response.json()

    def job(self, job_id: str) -> dict[str, Any]:
        response = httpx.get(f"{self.base_url}/v1/jobs/{job_id}", timeout=10)
        assert response.status_code == 200, response.text
        return response.json()

    def wait_finished(self, job_id: str, timeout_s: float) -> dict[str, Any]:
        return _wait_for(lambda: (j := self.job(job_id))["state"] in ("succeeded", "failed") and j,
                         timeout_s, f"job {job_id} to finish", interval_s=0.5)

    def counts(self, key: dict[str, Any]) -> tuple[int, int, int]:
        """Stored traces, plans and measurements of one plan key (architecture and input shape)."""
        from remat.service.models import Architecture

        shape = ",".join(str(d) for d in key["input_shape"])
        with self.db.read_session() as session:
            arch = session.execute(select(Architecture.id).where(Architecture.hash == key["model_hash"])).scalar_one()
            traces = session.execute(select(func.count()).select_from(TraceRow).where(
                TraceRow.architecture_id == arch, TraceRow.input_shape == shape)).scalar_one()
            plans = select(PlanRow.id).where(PlanRow.architecture_id == arch, PlanRow.input_shape == shape)
            num_plans = session.execute(select(func.count()).select_from(plans.subquery())).scalar_one()
            measured = session.execute(select(func.count()).select_from(MeasurementRow)
                                       .where(MeasurementRow.plan_id.in_(plans))).scalar_one()
        return traces, num_plans, measured


def _child_pids(parent: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True, check=False).stdout
    return [int(p) for p in out.split()]


@pytest.fixture(scope="module")
def cluster(pg_database_factory: Callable[[], str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("cluster")
    redis = PrivateRedis(port=_free_port(), workdir=workdir)
    redis.start()
    url = pg_database_factory()
    db = Database(url)
    migrate.upgrade(db)
    port = _free_port()
    env = {**os.environ, "REMAT_DATABASE_URL": url, "REMAT_BROKER_URL": redis.url, "REMAT_REDIS_URL": redis.url,
           "REMAT_API_TOKEN": TOKEN, "REMAT_PORT": str(port), "REMAT_JOB_LEASE_S": "6",
           "REMAT_REAP_INTERVAL_S": "1", "REMAT_PENDING_RESEND_AFTER_S": "1", "REMAT_AUTO_MIGRATE": "false",
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    service_log = open(workdir / "service.log", "wb")  # noqa: SIM115
    service = subprocess.Popen([sys.executable, "-m", "remat.service.main", "--no-access-log"], env=env,
                               stdout=service_log, stderr=subprocess.STDOUT, start_new_session=True, cwd=SRC)
    base_url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(f"{base_url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        _wait_for(lambda: healthy() or service.poll() is not None, 60, "the service to start")
        assert service.poll() is None, (workdir / "service.log").read_text()
        result = Cluster(env=env, redis=redis, base_url=base_url, db=db, logs=workdir)
        yield result
        result.kill_workers()
    finally:
        os.killpg(service.pid, signal.SIGKILL)
        service.wait(10)
        redis.stop()
        db.dispose()


@pytest.fixture
def cluster_workers(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster, with every worker a test started killed at its end (pass or fail)."""
    yield cluster
    cluster.kill_workers()


def _request(batch_size: int, side: int = 32, model: str = "resnet18") -> dict[str, Any]:
    return {"model": model, "batch_size": batch_size, "input_shape": [3, side, side], "device": "cpu",
            "grads": "kept"}


def _stored_once(result: dict[str, Any]) -> tuple[int, int, int]:
    """What one profile stores: one trace, a plan per planner and its frontier, their measurements (all and a
    handful of frontier points): the counts a job's result implies when nothing was stored twice."""
    entries = [*result["plans"], *result["frontier"]]
    assert len(result["plans"]) == len(PLANNERS) and len(result["frontier"]) >= 2
    return 1, len(entries), sum(1 for e in entries if e["measurement"])


def test_a_job_goes_from_submission_to_plans_that_train_identically(cluster_workers: Cluster) -> None:
    import torch
    import torchvision

    from remat.client.fetch import fetch_and_apply

    cluster = cluster_workers
    cluster.start_worker("solo")
    job = cluster.submit(_request(2, 64))
    assert job["state"] == "queued" and job["queue"] == "cpu"
    done = cluster.wait_finished(job["id"], 240)
    assert done["state"] == "succeeded", done
    assert done["plan_key"] == done["result"]["key"] and done["progress"] == 1.0 and done["attempts"] == 1
    plans = {e["plan"]["algorithm"]: e for e in done["result"]["plans"]}
    assert set(plans) == set(PLANNERS)
    for entry in plans.values():  # every plan validated by a real step, prediction beside measurement
        m = entry["measurement"]
        assert m["grad_check_passed"] is True and m["measured_peak_bytes"] > 0
        assert abs(m["measured_peak_bytes"] - entry["plan"]["predicted_peak_bytes"]) <= 0.01 * m["measured_peak_bytes"]
    frontier = done["result"]["frontier"]  # the time-memory curve, tightest first, a handful measured
    assert [e["plan"]["budget_bytes"] for e in frontier] == sorted(e["plan"]["predicted_peak_bytes"] for e in frontier)
    measured_points = [e for e in frontier if e["measurement"]]
    assert len(measured_points) >= 2
    for entry in measured_points:
        assert entry["measurement"]["measured_peak_bytes"] == pytest.approx(entry["plan"]["predicted_peak_bytes"],
                                                                            rel=0.01)

    torch.manual_seed(0)
    reference = torchvision.models.resnet18(weights=None)
    planned = torchvision.models.resnet18(weights=None)
    planned.load_state_dict(reference.state_dict())
    fetch_and_apply(planned, (2, 3, 64, 64), server=cluster.base_url, grads="kept")
    x = torch.randn(2, 3, 64, 64)
    losses = []
    for model in (reference, planned):
        model.train()
        loss = model(x).square().mean()
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    for a, b in zip(reference.parameters(), planned.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)

    again = cluster.wait_finished(cluster.submit(_request(2, 64))["id"], 120)  # same key: answered at once
    assert again["state"] == "succeeded" and again["result"]["reused"] is True
    assert cluster.counts(done["plan_key"]) == _stored_once(done["result"]) == (
        1, len(PLANNERS) + len(frontier), len(PLANNERS) + len(measured_points))

    # The CLI: submit prints the job id; status shows the plans; status --wait --json the finished job.
    cli = [sys.executable, "-m", "remat.client.cli"]
    submitted = subprocess.run([*cli, "submit", "resnet18", "--batch-size", "2", "--input-shape", "3,64,64",
                                "--grads", "kept", "--server", cluster.base_url], env=cluster.env,
                               capture_output=True, text=True, timeout=120, check=False)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    waited = subprocess.run([*cli, "status", job_id, "--wait", "--json", "--server", cluster.base_url],
                            env=cluster.env, capture_output=True, text=True, timeout=120, check=False)
    assert waited.returncode == 0 and json.loads(waited.stdout)["result"]["reused"] is True
    shown = subprocess.run([*cli, "status", job_id, "--server", cluster.base_url], env=cluster.env,
                           capture_output=True, text=True, timeout=120, check=False)
    assert shown.returncode == 0 and "linear" in shown.stdout and job_id in shown.stdout


def _wait_running_on(cluster: Cluster, job_id: str) -> dict[str, Any]:
    """The job once a worker has got well into it (the model built, profiling under way)."""
    return _wait_for(lambda: (j := cluster.job(job_id))["state"] == "running" and j["plan_key"] is not None and j,
                     120, f"job {job_id} to be running", interval_s=0.2)


@pytest.mark.parametrize("rounds", [1, pytest.param(3, marks=pytest.mark.soak, id="soak")])
@pytest.mark.parametrize("kill", ["child", "whole worker"])
def test_a_job_survives_a_killed_worker_with_another_running(cluster_workers: Cluster, kill: str, rounds: int) -> None:
    """One kill in the default run; ``-m soak`` kills again in each of three rounds (the survivor or the
    replacement takes the next job and survives its kill too): each round is a profile run twice, the suite's
    heaviest half-minute."""
    cluster = cluster_workers
    first = cluster.start_worker("a")
    second = cluster.start_worker("b")
    for repeat in range(rounds):
        job = cluster.submit(_request(3 if kill == "child" else 5, side=32 + 8 * repeat))
        running = _wait_running_on(cluster, job["id"])
        child = int(running["lease_owner"].rsplit(":", 1)[1])  # the lease names host:pid of the process
        (victim,) = [w for w in (first, second) if child in _child_pids(w.pid)]
        killed_at = time.monotonic()
        if kill == "child":  # what the kernel's OOM killer does
            os.kill(child, signal.SIGKILL)
        else:  # a node lost: parent and child gone, nothing acknowledged
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait(10)
        done = cluster.wait_finished(job["id"], 120)
        assert done["state"] == "succeeded", done
        assert time.monotonic() - killed_at < 120
        assert done["attempts"] >= 2 and done["result"]["reused"] is False
        assert cluster.counts(done["plan_key"]) == _stored_once(done["result"]), f"repeat {repeat}"
        if kill == "whole worker" and repeat + 1 < rounds:  # a node came back: the next round has two workers again
            replacement = cluster.start_worker(f"r{repeat}")
            first, second = (second, replacement) if victim is first else (first, replacement)


def test_eight_concurrent_submissions_run_one_profile(cluster_workers: Cluster) -> None:
    cluster = cluster_workers
    cluster.start_worker("a")
    cluster.start_worker("b")
    request = _request(7)
    results: list[dict[str, Any]] = []
    barrier = threading.Barrier(8)

    def submit() -> None:
        barrier.wait()
        results.append(cluster.submit(request))

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    finished = [cluster.wait_finished(job["id"], 240) for job in results]
    assert all(job["state"] == "succeeded" for job in finished), finished
    leaders = [job for job in finished if job["leader_id"] is None]
    assert len(leaders) == 1 and leaders[0]["attempts"] == 1
    assert all(job["leader_id"] == leaders[0]["id"] and job["attempts"] == 0 for job in finished
               if job is not leaders[0])
    assert all(job["result"] == leaders[0]["result"] for job in finished)
    assert cluster.counts(leaders[0]["plan_key"]) == _stored_once(leaders[0]["result"])


def test_a_job_queued_when_redis_dies_is_run_once_redis_is_back(cluster_workers: Cluster) -> None:
    cluster = cluster_workers
    job = cluster.submit(_request(8))  # no worker yet: the message waits in Redis
    assert job["state"] == "queued"
    cluster.redis.stop()  # no persistence: the message is gone
    try:
        health = httpx.get(f"{cluster.base_url}/healthz", timeout=10).json()
        assert health["status"] == "degraded" and health["broker"]["ok"] is False and health["database"]["ok"]
        assert cluster.job(job["id"])["state"] == "queued"  # reads come from the database
        listed = httpx.get(f"{cluster.base_url}/v1/jobs", timeout=10).json()
        assert job["id"] in {j["id"] for j in listed["data"]}
        late = cluster.submit(_request(9))  # accepted and kept until the broker is back
        assert late["state"] == "pending" and "waiting for the broker" in late["message"]
    finally:
        cluster.redis.start()
    assert httpx.get(f"{cluster.base_url}/healthz", timeout=10).json()["status"] == "ok"
    cluster.start_worker("after", REMAT_REQUEUE_AFTER_S="2")
    for job_id in (job["id"], late["id"]):
        done = cluster.wait_finished(job_id, 240)
        assert done["state"] == "succeeded", done


def test_bad_submissions_are_refused_and_not_queued(cluster: Cluster) -> None:
    unknown = httpx.post(f"{cluster.base_url}/v1/jobs", json=_request(1, model="resnet1888"), headers=AUTH,
                         timeout=60)
    assert unknown.status_code == 422 and unknown.json()["detail"].startswith("model: unknown model 'resnet1888'")
    wrong_queue = httpx.post(f"{cluster.base_url}/v1/jobs", json={**_request(1), "queue": "cuda"}, headers=AUTH,
                             timeout=60)
    assert wrong_queue.status_code == 422 and wrong_queue.json()["detail"].startswith("queue:")
    with cluster.db.read_session() as session:
        assert session.execute(select(func.count()).select_from(JobRow)
                               .where(JobRow.request["batch_size"].as_integer() == 1)).scalar_one() == 0


def test_a_deferred_cubic_plan_is_computed_on_the_plan_queue(cluster_workers: Cluster) -> None:
    from tests.service.factories import trace_dict

    cluster = cluster_workers
    trace = trace_dict(num_stages=300, model_hash="e2e-plan-queue")
    uploaded = httpx.post(f"{cluster.base_url}/v1/traces", json=trace, headers=AUTH, timeout=60).json()
    (deferred,) = uploaded["deferred"]
    cluster.start_worker("planner", queues="plan")
    done = cluster.wait_finished(deferred["job_id"], 120)
    assert done["state"] == "succeeded", done
    (entry,) = done["result"]["plans"]
    key = uploaded["key"]
    stored = httpx.get(f"{cluster.base_url}/v1/plans/{key['model_hash']}", timeout=10, params={
        "input_shape": ",".join(map(str, key["input_shape"])), "dtype": key["dtype"], "device": key["device"],
        "grads": key["grads"], "algorithm": "cubic"})
    assert stored.status_code == 200, stored.text
    assert stored.json()["plan"]["checkpoints"] == entry["plan"]["checkpoints"]


@pytest.mark.zoo  # three minutes on 2 cores: run with `uv run pytest -m zoo`; the quickstart test covers one worker
def test_a_zoo_batch_runs_on_two_workers_and_a_rerun_answers_from_the_store(cluster_workers: Cluster) -> None:
    """`remat-client zoo torchvision --filter 'resnet*' --server URL`: five models, two CPU workers."""
    cluster = cluster_workers
    cluster.start_worker("zoo-a")
    cluster.start_worker("zoo-b")
    cli = [sys.executable, "-m", "remat.client.cli", "zoo", "torchvision", "--filter", "resnet*", "--batch-size", "2",
           "--input-shape", "3,32,32", "--grads", "kept", "--server", cluster.base_url, "--json"]
    first = subprocess.run(cli, env=cluster.env, capture_output=True, text=True, timeout=900, check=False)
    assert first.returncode == 0, first.stderr
    result = json.loads(first.stdout)
    rows = {r["model"]: r for r in result["rows"]}
    assert sorted(rows) == [f"torchvision:resnet{d}" for d in (101, 152, 18, 34, 50)]
    for row in rows.values():
        assert row["status"] == "planned" and row["grad_check_passed"] is True, row
        assert row["input_shape"] == [2, 3, 32, 32] and row["linear_peak_bytes"] < row["none_peak_bytes"]
        assert abs(row["prediction_error"]) < 0.01
    assert first.stderr.count("✓ resnet") == 5 and f"zoo batch {result['batch_id']}" in first.stderr
    # Both workers took jobs (each worker's log names the tasks it received).
    for name, index in (("zoo-a", 0), ("zoo-b", 1)):
        log = (cluster.logs / f"worker-{name}-{index}.log").read_text()
        assert "profile_model" in log and "received" in log, log[-2000:]
    again = subprocess.run(cli, env=cluster.env, capture_output=True, text=True, timeout=300, check=False)
    assert again.returncode == 0, again.stderr
    assert {r["status"] for r in json.loads(again.stdout)["rows"]} == {"stored"}
