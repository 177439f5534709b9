"""Server time and size of every web page with a full plan cache: p50/p95 per page on loopback.

Seeds ``--keys`` architectures (default 1,000; one plan key each, every registered planner's plan measured with a
memory timeline, the frontier stored with two points measured: tests/utils/ui_seed.py), one profiling job per key
with a worker's result, and a zoo batch of ``--batch-models`` models (default 80, torchvision's classifier count)
mostly finished, into a SQLite file (or ``--database-url``); starts ``remat-service`` in a subprocess on 127.0.0.1
(no Redis, no broker), waits for its start-up work to settle, then requests each page ``--requests`` times over one
keep-alive connection, one request at a time, and prints per page the median and 95th percentile of the time from
sending the request to the last byte of the answer (an upper bound of the server's time: loopback, one client),
and the answer's size; "first" is the page's first request, before anything of it is cached.

    uv run python benchmarks/ui_pages.py                        # 1,000 keys, 200 requests per page
    uv run python benchmarks/ui_pages.py --keys 200 --requests 50

Pictures are measured three ways: drawn (a different key each request, so the picture cache never has it), cached
(the same key again: the key's version is read, the drawn picture reused) and revalidated (the browser's
``If-None-Match``: 304). Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.utils.ui_seed: the seeded store

from remat.client.job_state import JobState  # noqa: E402
from remat.client.request import ModelRequest  # noqa: E402
from remat.service import jobs, migrate, zoo  # noqa: E402
from remat.service.db import Database  # noqa: E402
from remat.service.models import JobRow  # noqa: E402
from remat.service.ui.links import key_url  # noqa: E402
from tests.utils.ui_seed import MODELS, Seeded, architecture_hash, job_result, seed_keys  # noqa: E402

HOST = "127.0.0.1"


def seed(url: str, keys: int, batch_models: int) -> tuple[Seeded, list[str]]:
    """The store: ``keys`` planned keys, a finished job per key, and one zoo batch; returns the seeded keys and
    the ids of a few jobs."""
    db = Database(url)
    migrate.ensure_current(db)
    seeded = Seeded()
    start = time.perf_counter()
    for first in range(0, keys, 100):
        seed_keys(db, min(100, keys - first), start=first, into=seeded)
    print(f"seeded {keys} keys in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    result = job_result()
    job_ids = []
    with db.write_session() as session:
        for i, key in enumerate(seeded.keys):
            request = ModelRequest(spec=seeded.names[i], batch_size=2 + i, sample_shape=(3, 64, 64)).to_dict()
            job, _ = jobs.create_job(session=session, request=request, queue="cpu", request_key=uuid.uuid4().hex)
            jobs.update_job(session=session, job_id=job.id, state=JobState.SUCCEEDED, progress=1.0,
                            message="done", result=result)
            row = session.get(JobRow, job.id)
            assert row is not None
            row.plan_key = key.to_dict()
            job_ids.append(job.id)
        requests = [ModelRequest(spec=MODELS[i % len(MODELS)], batch_size=1 + i // len(MODELS),
                                 sample_shape=(3, 64, 64)) for i in range(batch_models)]
        batch, _ = zoo.create_batch(session=session, zoo="torchvision", filter="*", template={"batch_size": None},
                                    requests=requests, queue="cpu", refresh=False)
        for i, job in enumerate(batch.jobs):
            if i < batch_models - 10:
                jobs.update_job(session=session, job_id=job.id, state=JobState.SUCCEEDED, progress=1.0,
                                message="done", result=result)
            elif i < batch_models - 5:
                jobs.update_job(session=session, job_id=job.id, state=JobState.FAILED,
                                error="RuntimeError: out of memory")
            else:
                jobs.update_job(session=session, job_id=job.id, state=JobState.RUNNING, progress=0.5,
                                message="measuring linear")
        seeded.batch_id = batch.id
    db.dispose()
    return seeded, job_ids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_service(url: str) -> tuple[subprocess.Popen[bytes], int]:
    port = _free_port()
    env = {**os.environ, "REMAT_DATABASE_URL": url, "REMAT_REDIS_URL": "",
           "REMAT_BROKER_URL": f"redis://{HOST}:{_free_port()}/0"}
    proc = subprocess.Popen([sys.executable, "-m", "remat.service.main", "--host", HOST, "--port", str(port),
                             "--no-access-log"], env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((HOST, port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        raise RuntimeError("remat-service did not start")
    # Start-up preloads the model zoo's names in a thread (torch): wait until the process is idle.
    last = _cpu_seconds(proc.pid)
    for _ in range(120):
        time.sleep(0.5)
        now = _cpu_seconds(proc.pid)
        if now - last < 0.02:
            break
        last = now
    return proc, port


def measure(conn: http.client.HTTPConnection, paths: Callable[[int], str], n: int,
            headers: Callable[[int], dict[str, str]] | None = None, expect: int = 200) -> tuple[list[float], int]:
    times, size = [], 0
    for i in range(n):
        start = time.perf_counter()
        conn.request("GET", paths(i), headers=headers(i) if headers else {})
        response = conn.getresponse()
        body = response.read()
        times.append((time.perf_counter() - start) * 1000)
        if response.status != expect:
            raise RuntimeError(f"{paths(i)}: HTTP {response.status}: {body[:300]!r}")
        size = max(size, len(body))
    return times, size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--batch-models", type=int, default=80)
    parser.add_argument("--requests", type=int, default=200, help="requests per page")
    parser.add_argument("--database-url", help="default: a SQLite file in a temporary directory")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="remat-ui-bench-"))
    url = args.database_url or f"sqlite:///{directory / 'plans.sqlite'}"
    seeded, job_ids = seed(url, args.keys, args.batch_models)
    proc, port = start_service(url)
    rng = random.Random(0)
    keys = seeded.keys
    n = args.requests
    try:
        conn = http.client.HTTPConnection(HOST, port, timeout=30)
        etags: dict[str, str] = {}

        def etag_of(path: str) -> dict[str, str]:
            if path not in etags:
                conn.request("GET", path)
                response = conn.getresponse()
                response.read()
                etags[path] = response.getheader("ETag") or ""
            return {"If-None-Match": etags[path]}

        picture_keys = list(keys)
        rng.shuffle(picture_keys)
        timeline_draws, frontier_draws = itertools.count(), itertools.count()
        pages: list[tuple[str, Callable[[int], str], Callable[[int], dict[str, str]] | None, int]] = [
            ("architectures, page 1", lambda i: "/ui/", None, 200),
            ("architectures, page 20", lambda i: "/ui/?page=20", None, 200),
            ("architectures, search by name", lambda i: "/ui/?q=resnet", None, 200),
            ("architectures, search by hash", lambda i: f"/ui/?q={architecture_hash(i % len(keys))[:6]}", None, 200),
            ("one key", lambda i: key_url(rng.choice(keys)), None, 200),
            ("timeline picture, drawn",
             lambda i: key_url(picture_keys[next(timeline_draws) % len(keys)], "/timeline.svg"), None, 200),
            ("timeline picture, cached", lambda i: key_url(keys[0], "/timeline.svg"), None, 200),
            ("timeline picture, revalidated", lambda i: key_url(keys[0], "/timeline.svg"),
             lambda i: etag_of(key_url(keys[0], "/timeline.svg")), 304),
            ("frontier picture, drawn",
             lambda i: key_url(picture_keys[-1 - next(frontier_draws) % len(keys)], "/frontier.svg"), None, 200),
            ("frontier picture, cached", lambda i: key_url(keys[0], "/frontier.svg"), None, 200),
            ("jobs", lambda i: "/ui/jobs", None, 200),
            ("one job", lambda i: f"/ui/jobs/{rng.choice(job_ids)}", None, 200),
            ("zoo batches", lambda i: "/ui/zoo", None, 200),
            (f"zoo batch of {args.batch_models}", lambda i: f"/ui/zoo/{seeded.batch_id}", None, 200),
        ]
        print(f"# {args.keys} keys, {args.batch_models}-model batch, {n} requests per page, one connection; "
              f"{platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} CPUs")
        print("| page | first ms | p50 ms | p95 ms | max ms | bytes |\n|---|---:|---:|---:|---:|---:|")
        for name, path, headers, expect in pages:
            first, _ = measure(conn, path, 1, headers, expect)  # cold: nothing of it cached yet
            measure(conn, path, min(4, n), headers, expect)  # warm the code path
            times, size = measure(conn, path, n, headers, expect)
            p95 = statistics.quantiles(times, n=100, method="inclusive")[94]
            print(f"| {name} | {first[0]:.1f} | {statistics.median(times):.1f} | {p95:.1f} | {max(times):.1f} "
                  f"| {size:,} |")
        conn.close()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
