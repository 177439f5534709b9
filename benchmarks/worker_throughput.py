"""Jobs per minute of the profiling workers: 10 small zoo models, with 1 and with 2 CPU workers.

Starts what a deployment runs, each as its own process: a private redis-server (random port), the service
(``remat-service``) on loopback and N ``remat-worker`` processes on the ``cpu`` queue, all on a fresh SQLite
(or ``--database-url``) database per run, so that no job is answered from an earlier run's plans. Submits
every model at once through the API and times from the first submission to the last job's end; each job
profiles, plans with every algorithm and validates every plan with real training steps.

    uv run python benchmarks/worker_throughput.py                       # 1 and 2 workers
    uv run python benchmarks/worker_throughput.py --workers 1,2,4 --batch-size 2 --image-size 64

Torch threads are split between the workers (``OMP_NUM_THREADS`` = cores / workers), as one would on a node.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

MODELS = ("resnet18", "resnet34", "mobilenet_v2", "mobilenet_v3_small", "squeezenet1_1", "mobilenet_v3_large",
          "mnasnet0_5", "efficientnet_b0", "regnet_x_400mf", "densenet121")
TOKEN = "benchmark-token"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise SystemExit(f"worker_throughput: timed out waiting for {what}")


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def run(num_workers: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One measurement: a fresh database, the service, ``num_workers`` workers and every model submitted."""
    redis_port, port = _free_port(), _free_port()
    database_url = args.database_url or f"sqlite:///{workdir / f'run-{num_workers}.sqlite'}"
    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        raise SystemExit("worker_throughput: redis-server is not on PATH")
    processes: list[subprocess.Popen[bytes]] = []
    threads = max(1, (os.cpu_count() or 1) // num_workers)
    env = {**os.environ, "REMAT_DATABASE_URL": database_url, "REMAT_BROKER_URL": f"redis://127.0.0.1:{redis_port}/0",
           "REMAT_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0", "REMAT_API_TOKEN": TOKEN,
           "REMAT_PORT": str(port), "OMP_NUM_THREADS": str(threads)}
    try:
        processes.append(subprocess.Popen([redis_bin, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                           "--appendonly", "no", "--dir", str(workdir)], stdout=subprocess.DEVNULL,
                                          start_new_session=True))
        service_log = open(workdir / f"service-{num_workers}.log", "wb")  # noqa: SIM115
        processes.append(subprocess.Popen([sys.executable, "-m", "remat.service.main", "--no-access-log"], env=env,
                                          stdout=service_log, stderr=subprocess.STDOUT, start_new_session=True))
        base = f"http://127.0.0.1:{port}"
        _wait(lambda: _healthy(base), 120, "the service")
        logs = []
        for k in range(num_workers):
            log = workdir / f"worker-{num_workers}-{k}.log"
            logs.append(log)
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "remat.worker.cli", "--queues", "cpu", "-c", "1", "-n", f"bench{k}@%h"],
                env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True))  # noqa: SIM115
        _wait(lambda: all(b"ready." in log.read_bytes() for log in logs), 120, "the workers")
        request = {"batch_size": args.batch_size, "input_shape": [3, args.image_size, args.image_size],
                   "device": "cpu", "grads": "kept"}
        start = time.monotonic()
        ids = []
        for model in args.models:
            response = httpx.post(f"{base}/v1/jobs", json={**request, "model": model}, timeout=120,
                                  headers={"Authorization": f"Bearer {TOKEN}"})
            response.raise_for_status()
            ids.append(response.json()["id"])
        pending = set(ids)
        jobs: dict[str, dict[str, Any]] = {}
        while pending:
            time.sleep(0.5)
            for job_id in list(pending):
                job = httpx.get(f"{base}/v1/jobs/{job_id}", timeout=10).json()
                if job["state"] in ("succeeded", "failed"):
                    jobs[job_id] = job
                    pending.discard(job_id)
            if time.monotonic() - start > args.timeout_s:
                raise SystemExit(f"worker_throughput: {len(pending)} jobs unfinished after {args.timeout_s} s")
        elapsed = time.monotonic() - start
        failed = {j["request"]["model"]: j["error"] for j in jobs.values() if j["state"] == "failed"}
        per_job = sorted((j["request"]["model"], _seconds(j["started_at"], j["finished_at"])) for j in jobs.values())
        return {"workers": num_workers, "torch_threads": threads, "jobs": len(ids), "failed": failed,
                "elapsed_s": round(elapsed, 1), "jobs_per_minute": round(60 * len(ids) / elapsed, 2),
                "job_s": dict(per_job)}
    finally:
        for process in reversed(processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)  # every process leads its own session
                try:
                    process.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)


def _seconds(start: str | None, end: str | None) -> float | None:
    from datetime import datetime

    if start is None or end is None:
        return None
    return round((datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds(), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts to measure")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--database-url", default=None, help="default: a fresh SQLite file per run")
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.models = [m for m in args.models.split(",") if m]
    results = []
    with tempfile.TemporaryDirectory(prefix="remat-throughput-") as tmp:
        for n in (int(w) for w in args.workers.split(",")):
            results.append(run(n, args, Path(tmp)))
            if not args.json:
                r = results[-1]
                print(f"{n} worker(s), {r['torch_threads']} torch thread(s) each: {r['jobs']} jobs in "
                      f"{r['elapsed_s']} s = {r['jobs_per_minute']} jobs/min; failed: {r['failed'] or 'none'}",
                      flush=True)
                print("  per job (s):", ", ".join(f"{m} {s}" for m, s in r["job_s"].items()), flush=True)
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
