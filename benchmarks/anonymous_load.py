"""Latency of ``/healthz`` and of a plan fetch while anonymous clients send large bodies to the write routes.

Before issue 31, FastAPI read and ``json.loads``-ed every body before the route's token check ran, on the event
loop: four anonymous clients sending 15 MB each held the one process that also answers ``/healthz`` and plan
fetches. Now the token is checked from the headers before the body is read (service/api/service_route.py).

Starts ``remat-service`` (one uvicorn worker, a SQLite file in a temporary directory, the local Redis as plan
cache under a throw-away prefix) on 127.0.0.1, seeds a few plan keys, then measures one keep-alive client that
alternates ``GET /healthz`` and a cached ``GET /v1/plans/{hash}``: first alone, then while ``--attackers``
processes each loop over ``POST /v1/measurements``, ``/v1/jobs`` and ``/v1/zoo`` with a ``--body-mb`` body of
valid JSON and no token. Prints p50/p99/max per route and what the attackers got.

    uv run python benchmarks/anonymous_load.py                     # 4 attackers, 15 MB, 20 s a phase

Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from service_load import HOST, REDIS_URL, _free_port, _percentile, clear_cache, seed, wait_ready

WRITE_ROUTES = ("/v1/measurements", "/v1/jobs", "/v1/zoo")


def _json_body(size: int) -> bytes:
    """Valid JSON of ``size`` bytes: what a parser would have to read and decode in full."""
    head, tail = b'{"extra": {"pad": "', b'"}}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


def attacker(port: int, body_mb: float, stop_at: float, counts: dict[str, int]) -> None:
    """Send anonymous bodies in a loop, a new connection each time (the server may close after refusing)."""
    body = _json_body(int(body_mb * 1024 * 1024))
    i = 0
    while time.time() < stop_at:
        route = WRITE_ROUTES[i % len(WRITE_ROUTES)]
        i += 1
        try:
            with socket.create_connection((HOST, port), timeout=30) as s:
                s.sendall(f"POST {route} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
                try:
                    s.sendall(body)
                except OSError:
                    pass  # refused before the body was read: the server closed its side
                status = s.recv(64).split(b" ", 2)[1].decode()
        except (OSError, IndexError):
            status = "error"
        counts[status] = counts.get(status, 0) + 1


def measure(port: int, plan_path: str, duration_s: float) -> dict[str, list[float]]:
    """One keep-alive connection alternating the two reads; latencies in ms per route."""
    latencies: dict[str, list[float]] = {"/healthz": [], "plan fetch": []}
    deadline = time.perf_counter() + duration_s
    with socket.create_connection((HOST, port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = s.makefile("rb")
        turn = 0
        while time.perf_counter() < deadline:
            name, path = ("/healthz", "/healthz") if turn % 2 == 0 else ("plan fetch", plan_path)
            turn += 1
            start = time.perf_counter()
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\nAccept: application/json\r\n\r\n".encode())
            status = reader.readline()
            length = 0
            while (line := reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            reader.read(length)
            if b" 200 " not in status:
                raise SystemExit(f"{path}: {status!r}")
            latencies[name].append((time.perf_counter() - start) * 1000)
    return latencies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attackers", type=int, default=4, help="processes sending anonymous bodies")
    parser.add_argument("--body-mb", type=float, default=15.0, help="size of each anonymous body")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per phase")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="remat-bench-") as tmp:
        database_url = f"sqlite:///{Path(tmp) / 'bench.sqlite'}"
        prefix = f"remat-bench-{uuid.uuid4().hex[:8]}:"
        paths = seed(database_url, 20)
        port = _free_port()
        env = {**os.environ, "REMAT_DATABASE_URL": database_url, "REMAT_REDIS_URL": REDIS_URL,
               "REMAT_CACHE_PREFIX": prefix, "REMAT_CACHE_TTL_S": "600", "REMAT_API_TOKEN": uuid.uuid4().hex}
        proc = subprocess.Popen(
            [sys.executable, "-m", "remat.service.main", "serve", "--host", HOST, "--port", str(port),
             "--no-access-log"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        rows = []
        try:
            wait_ready(port, proc)
            measure(port, paths[0], 2.0)  # warm-up: fills the cache for the fetched key
            rows.append(("idle", measure(port, paths[0], args.duration), {}))
            with mp.Manager() as manager:
                counts = manager.dict()
                stop_at = time.time() + args.duration + 2.0
                workers = [mp.Process(target=attacker, args=(port, args.body_mb, stop_at, counts))
                           for _ in range(args.attackers)]
                for w in workers:
                    w.start()
                time.sleep(1.0)  # every attacker sending
                loaded = measure(port, paths[0], args.duration)
                for w in workers:
                    w.join()
                rows.append((f"{args.attackers} x {args.body_mb:g} MB anonymous", loaded, dict(counts)))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            clear_cache(prefix)

    print(f"remat-service on {HOST}, 1 uvicorn worker, SQLite, Redis cache; {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}")
    print(f"{'phase':<28}{'route':<12}{'requests':>9}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}  attackers got")
    for phase, latencies, counts in rows:
        for route, values in latencies.items():
            got = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) if route == "/healthz" else ""
            print(f"{phase:<28}{route:<12}{len(values):>9}{_percentile(values, 50):>9.2f}"
                  f"{_percentile(values, 99):>9.2f}{max(values):>9.2f}  {got}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
