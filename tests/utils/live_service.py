"""A real remat service on a real socket, in a thread: what a training job's client talks to in a cluster."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import uvicorn

from remat.service.api.app import create_app
from remat.service.config import ServiceSettings
from tests.service.factories import TOKEN, closed_port_url


def live_database_url(directory: Path) -> str:
    """The SQLite file ``live_service(directory)`` serves (seed it before the service starts)."""
    return f"sqlite:///{directory / 'plans.sqlite'}"


@contextmanager
def live_service(directory: Path, **settings_overrides: Any) -> Iterator[str]:
    """The service (a SQLite file in ``directory``, the write token ``TOKEN``, no Redis, and any other
    ``ServiceSettings`` given) at a port the kernel chose, on 127.0.0.1; yields its URL and stops it on exit."""
    settings = ServiceSettings(**{"database_url": live_database_url(directory), "redis_url": None,
                                  "broker_url": closed_port_url(), "api_token": TOKEN, "auto_migrate": True,
                                  **settings_overrides})
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(settings), log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    try:
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test service did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
