"""Plan-fetch latency and throughput of the HTTP service, cache miss vs hit, on loopback.

Starts ``remat-service`` in a subprocess on 127.0.0.1 (a SQLite file in a temporary directory unless
``--database-url`` is given, the local Redis as cache under a throw-away key prefix), seeds ``--keys``
distinct plan keys straight into the database, then fetches every key twice with ``--concurrency``
keep-alive connections: the first pass misses the cache (Redis GET, database read, Redis SET), the second
hits it. Each pass is bounded by ``--duration`` seconds. Prints one table row per pass.

    uv run python benchmarks/service_load.py                  # defaults: 2000 keys, 4 connections
    uv run python benchmarks/service_load.py --workers 2 --database-url postgresql+psycopg://...

The load generator is a minimal asyncio HTTP/1.1 client (no httpx) so that, on a small machine, the
client's own CPU use disturbs the server as little as possible. Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import redis

from remat.client.planning.plans import plan_all
from remat.client.trace import TRACE_FORMAT, parse_trace
from remat.service import repository
from remat.service.db import Database
from remat.service.migrate import ensure_current

REDIS_URL = "redis://127.0.0.1:6379/0"
HOST = "127.0.0.1"


@dataclass
class PassResult:
    name: str
    latencies_ms: list[float]
    wall_s: float
    errors: int
    cache_headers: dict[str, int]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def seed(database_url: str, num_keys: int) -> list[str]:
    """Store ``num_keys`` traces (one architecture hash each) and their plans; return the request paths."""
    db = Database(database_url)
    ensure_current(db)
    template = parse_trace({
        "format": TRACE_FORMAT, "input_bytes": 602112, "input_shape": [32, 3, 224, 224], "dtype": "float32",
        "device": "cuda", "model": "bench-net",
        "stages": [{"name": f"layer{i}", "output_bytes": 1_000_000 + 5_000 * i, "saved_bytes": 800_000,
                    "forward_ms": 0.4, "backward_ms": 0.8} for i in range(1, 51)]})
    plans = plan_all(template)
    paths = []
    with db.write_session() as session:
        for i in range(num_keys):
            model_hash = f"bench-{i:06d}"
            trace = parse_trace({**template.to_dict(), "model_hash": model_hash})
            stored = repository.store_trace(session=session, trace=trace)
            repository.store_plans(session=session, trace_id=stored.trace_id, plans=plans)
            paths.append(f"/v1/plans/{model_hash}?input_shape=32,3,224,224&dtype=float32&device=cuda")
    db.dispose()
    return paths


async def _fetch_all(port: int, paths: list[str], concurrency: int, deadline: float) -> PassResult:
    latencies: list[float] = []
    errors = 0
    headers: dict[str, int] = {}
    queue = list(reversed(paths))

    async def connection() -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection(HOST, port)
        try:
            while queue and time.perf_counter() < deadline:
                path = queue.pop()
                request = f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\nAccept: application/json\r\n\r\n".encode()
                start = time.perf_counter()
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                fields = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                await reader.readexactly(int(fields.get("content-length", "0")))
                latencies.append((time.perf_counter() - start) * 1000)
                if " 200 " not in lines[0]:
                    errors += 1
                cache = fields.get("x-remat-cache", "none")
                headers[cache] = headers.get(cache, 0) + 1
        finally:
            writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(connection() for _ in range(concurrency)))
    return PassResult("", latencies, time.perf_counter() - start, errors, headers)


def run_pass(name: str, port: int, paths: list[str], concurrency: int, duration_s: float) -> PassResult:
    result = asyncio.run(_fetch_all(port, paths, concurrency, time.perf_counter() + duration_s))
    result.name = name
    return result


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def print_table(results: list[PassResult], concurrency: int) -> None:
    print(f"{'pass':<18}{'requests':>9}{'conns':>7}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}"
          f"{'non-200':>9}  cache header")
    for r in results:
        lat = r.latencies_ms
        print(f"{r.name:<18}{len(lat):>9}{concurrency:>7}{len(lat) / r.wall_s:>9.0f}{_percentile(lat, 50):>9.2f}"
              f"{_percentile(lat, 99):>9.2f}{max(lat):>9.2f}{r.errors:>9}  "
              + ", ".join(f"{k}={v}" for k, v in sorted(r.cache_headers.items())))


def clear_cache(prefix: str) -> None:
    """Delete the benchmark's keys from the shared Redis."""
    cache = redis.Redis.from_url(REDIS_URL)
    for key in cache.scan_iter(match=f"{prefix}*"):
        cache.delete(key)
    cache.close()


def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"service exited with {proc.returncode} before it was ready")
        try:
            with socket.create_connection((HOST, port), timeout=0.5) as s:
                s.sendall(f"GET /healthz HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"service not ready on port {port} after {timeout_s:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=2000, help="distinct plan keys = requests per pass")
    parser.add_argument("--concurrency", type=int, default=4, help="keep-alive connections")
    parser.add_argument("--duration", type=float, default=30.0, help="upper bound per pass, seconds")
    parser.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")
    parser.add_argument("--database-url", default=None, help="default: a SQLite file in a temp directory")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="remat-bench-") as tmp:
        database_url = args.database_url or f"sqlite:///{Path(tmp) / 'bench.sqlite'}"
        prefix = f"remat-bench-{uuid.uuid4().hex[:8]}:"
        t0 = time.perf_counter()
        paths = seed(database_url, args.keys)
        print(f"seeded {len(paths)} plan keys in {time.perf_counter() - t0:.1f} s")
        port = _free_port()
        env = {**os.environ, "REMAT_DATABASE_URL": database_url, "REMAT_REDIS_URL": REDIS_URL,
               "REMAT_CACHE_PREFIX": prefix, "REMAT_CACHE_TTL_S": "600", "REMAT_API_TOKEN": uuid.uuid4().hex}
        proc = subprocess.Popen(
            [sys.executable, "-m", "remat.service.main", "serve", "--host", HOST, "--port", str(port),
             "--workers", str(args.workers), "--no-access-log"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_ready(port, proc)
            run_pass("warm-up", port, paths[:50], args.concurrency, args.duration)
            clear_cache(prefix)
            results = [run_pass(name, port, paths, args.concurrency, args.duration)
                       for name in ("miss (DB + fill)", "hit (Redis)")]
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            clear_cache(prefix)
    db_kind = database_url.split(":", 1)[0]
    print(f"remat-service on {HOST}, {args.workers} uvicorn worker(s), database {db_kind}, Redis cache; "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}")
    print_table(results, args.concurrency)
    return 0 if all(r.errors == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
