"""The README's cluster quickstart, by hand, on this machine: the same console scripts with the same options
against the real PostgreSQL and Redis, the API and one worker as subprocesses, a zoo of three small models,
then a training job that fetches its plan and trains identically.

Every command run here must appear, as written, in the README's "By hand" block: change one and this test
says which, so the quickstart cannot rot.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tests.conftest import require_service
from tests.service.test_workers_e2e import SRC, _free_port, _wait_for

BIN = Path(sys.executable).parent
REDIS_URL = "redis://127.0.0.1:6379/9"  # a database of its own: flushed before and after
ZOO_FILTER = "squeezenet1_1,mobilenet_v3_small,resnet18"
SMALL = ["--batch-size", "2", "--input-shape", "3,64,64", "--grads", "kept"]


def _readme_block() -> str:
    text = (SRC / "README.md").read_text()
    match = re.search(r"### By hand\n.*?```bash\n(.*?)```", text, re.S)
    assert match, "README.md has no '### By hand' bash block under the cluster quickstart"
    return match.group(1)


def _in_readme(block: str, argv: list[str]) -> None:
    shown = " ".join(a if re.fullmatch(r"[\w.,:/=+-]+", a) else f"'{a}'" for a in argv)
    assert f"uv run {shown}" in block, f"the README's by-hand block no longer says: uv run {shown}"


@pytest.fixture
def redis_db() -> Iterator[str]:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.RedisError as exc:
        require_service("Redis", False, str(exc))
    client.flushdb()
    yield REDIS_URL
    client.flushdb()
    client.close()


def test_the_readme_by_hand_quickstart_runs(pg_database_factory: Callable[[], str], redis_db: str,
                                            tmp_path: Path) -> None:
    block = _readme_block()
    port = _free_port()
    env = {**os.environ, "REMAT_DATABASE_URL": pg_database_factory(), "REMAT_REDIS_URL": redis_db,
           "REMAT_BROKER_URL": redis_db, "REMAT_API_TOKEN": "quickstart-token", "HOME": str(tmp_path),
           "REMAT_SERVER": f"http://127.0.0.1:{port}", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           # queues of this run only: a second test run on the machine must not take this run's jobs
           "REMAT_QUEUE_PREFIX": f"quickstart-{uuid.uuid4().hex[:8]}-"}
    steps = {
        "migrate": ["remat-service", "migrate"],
        "api": ["remat-service", "--host", "0.0.0.0", "--port", "8000"],
        "worker": ["remat-worker", "--queues", "cpu,plan"],
        "zoo": ["remat-client", "zoo", "torchvision", "--filter", ZOO_FILTER, *SMALL],
        "plan": ["remat-client", "plan", "resnet18", *SMALL],
    }
    for argv in steps.values():
        _in_readme(block, argv)

    def run(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(BIN / argv[0]), *argv[1:]], env=env, capture_output=True, text=True,
                              timeout=timeout, check=False, cwd=tmp_path)

    migrated = run(steps["migrate"], 120)
    assert migrated.returncode == 0, migrated.stderr
    api_argv = [str(BIN / "remat-service"), "--host", "127.0.0.1", "--port", str(port)]  # loopback in a test
    worker_argv = [str(BIN / "remat-worker"), *steps["worker"][1:], "--hostname", "quickstart@%h"]
    logs = {name: open(tmp_path / f"{name}.log", "wb") for name in ("api", "worker")}  # noqa: SIM115
    processes = [subprocess.Popen(argv, env=env, stdout=logs[name], stderr=subprocess.STDOUT,
                                  start_new_session=True, cwd=tmp_path)
                 for name, argv in (("api", api_argv), ("worker", worker_argv))]
    try:
        def healthy() -> bool:
            try:
                return httpx.get(f"{env['REMAT_SERVER']}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        _wait_for(lambda: healthy() or processes[0].poll() is not None, 60, "the API to start")
        _wait_for(lambda: b"ready." in (tmp_path / "worker.log").read_bytes() or processes[1].poll() is not None,
                  60, "the worker to start")
        assert all(p.poll() is None for p in processes), (tmp_path / "worker.log").read_text()[-3000:]

        zoo = run([*steps["zoo"], "--json"], 600)
        assert zoo.returncode == 0, zoo.stderr + (tmp_path / "worker.log").read_text()[-3000:]
        rows = json.loads(zoo.stdout)["rows"]
        assert [r["model"].removeprefix("torchvision:") for r in rows] == ["mobilenet_v3_small", "resnet18",
                                                                          "squeezenet1_1"]
        assert all(r["status"] == "planned" and r["grad_check_passed"] for r in rows), rows

        planned = run([*steps["plan"], "--json"], 300)  # now from the service, by key
        assert planned.returncode == 0, planned.stderr
        report = json.loads(planned.stdout)
        assert report["from_store"] is True and report["server"] == env["REMAT_SERVER"]

        # A training job fetches its plan by key and trains exactly as without it.
        import torch
        import torchvision

        from remat.client.fetch import fetch_and_apply

        torch.manual_seed(0)
        reference = torchvision.models.resnet18(weights=None)
        model = torchvision.models.resnet18(weights=None)
        model.load_state_dict(reference.state_dict())
        fetch_and_apply(model, (2, 3, 64, 64), server=env["REMAT_SERVER"], grads="kept")
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
        for step in range(2):
            x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(step))
            losses = []
            for m, opt in zip((reference, model), optimizers, strict=True):
                loss = m(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=False)
                losses.append(loss.detach())
            assert torch.equal(losses[0], losses[1])
    finally:
        for p in processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        for f in logs.values():
            f.close()
