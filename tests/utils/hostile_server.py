"""A loopback HTTP server that misbehaves on purpose: what the client must survive (issue 31, suite (d)).

Every request gets what a *behaviour* writes on the raw socket, so a test can answer with foreign JSON, a body
cut short, one byte at a time, a 200 that never ends, a body past any cap, or a redirect to itself. The server
binds 127.0.0.1 only (tests address loopback; tests/loopback_guard.py) and serves each connection in a daemon
thread.

Every behaviour ends on its own after ``SAFETY_S`` even if the client never gives up, and none sends more than
a little past the client's answer cap: the same tests run against a client without a deadline or a cap (to show
that they fail there) must end, not hang or eat the machine's memory.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["SAFETY_S", "Connection", "answer", "endless", "hostile_server", "huge", "redirect_loop",
           "trickle", "trickle_headers", "truncated"]

SAFETY_S = 15.0
"""Longest any behaviour keeps a connection, whatever the client does."""


class Connection:
    """One accepted connection: the request's head, and sending that stops when the client has gone or the
    server is stopping."""

    def __init__(self, sock: socket.socket, stop: threading.Event) -> None:
        self.sock = sock
        self._stop = stop
        self._until = time.monotonic() + SAFETY_S
        self.head = b""

    @property
    def open(self) -> bool:
        return not self._stop.is_set() and time.monotonic() < self._until

    def send(self, data: bytes) -> bool:
        """Send all of ``data``; False once the client has closed the connection or time is up."""
        if not self.open:
            return False
        try:
            self.sock.sendall(data)
            return True
        except OSError:
            return False

    def pause(self, seconds: float) -> bool:
        """Wait ``seconds``; False when the server stops or time is up meanwhile."""
        return not self._stop.wait(seconds) and self.open


Behaviour = Callable[[Connection], None]


def _head(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {'OK' if status == 200 else 'Hostile'}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def answer(body: Any, status: int = 200, *, content_type: str = "application/json") -> Behaviour:
    """A whole answer: ``body`` as is when bytes or str, else its JSON."""
    raw = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode()

    def behave(conn: Connection) -> None:
        conn.send(_head(status, {"Content-Type": content_type, "Content-Length": str(len(raw)),
                                 "Connection": "close"}) + raw)

    return behave


def truncated(body: bytes) -> Behaviour:
    """A ``Content-Length`` twice the bytes sent, then the connection closed."""

    def behave(conn: Connection) -> None:
        conn.send(_head(200, {"Content-Type": "application/json", "Content-Length": str(2 * len(body))}) + body)

    return behave


def trickle(body: bytes, interval: float) -> Behaviour:
    """Headers at once, then the body one byte every ``interval`` seconds."""

    def behave(conn: Connection) -> None:
        if not conn.send(_head(200, {"Content-Type": "application/json", "Content-Length": str(len(body))})):
            return
        for i in range(len(body)):
            if not (conn.pause(interval) and conn.send(body[i:i + 1])):
                return

    return behave


def trickle_headers(interval: float) -> Behaviour:
    """The status line and then an endless header, one byte every ``interval`` seconds."""

    def behave(conn: Connection) -> None:
        data = b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 60_000
        for i in range(len(data)):
            if not (conn.send(data[i:i + 1]) and conn.pause(interval)):
                return

    return behave


def endless(interval: float, chunk_bytes: int = 1024, *, limit: int | None = None) -> Behaviour:
    """A chunked 200 that never ends: a chunk every ``interval`` seconds (0: as fast as the client reads), up
    to ``limit`` bytes in all, then silence with the connection held open."""

    def behave(conn: Connection) -> None:
        if not conn.send(_head(200, {"Content-Type": "application/json", "Transfer-Encoding": "chunked"})):
            return
        chunk = f"{chunk_bytes:x}\r\n".encode() + b" " * chunk_bytes + b"\r\n"
        sent = 0
        while limit is None or sent < limit:
            if not conn.send(chunk) or (interval and not conn.pause(interval)):
                return
            sent += chunk_bytes
        while conn.pause(0.1):
            pass

    return behave


def huge(declared: int, limit: int) -> Behaviour:
    """A ``Content-Length`` of ``declared`` bytes, of which ``limit`` are sent (fast), then silence."""

    def behave(conn: Connection) -> None:
        if not conn.send(_head(200, {"Content-Type": "application/json", "Content-Length": str(declared)})):
            return
        block = b" " * 65536
        for _ in range(0, limit, len(block)):
            if not conn.send(block):
                return
        while conn.pause(0.1):
            pass

    return behave


def redirect_loop(status: int = 307) -> Behaviour:
    """Every request is sent back to itself."""

    def behave(conn: Connection) -> None:
        target = conn.head.split(b" ", 2)[1].decode("latin-1") if conn.head.count(b" ") >= 2 else "/"
        conn.send(_head(status, {"Location": target, "Content-Length": "0"}))

    return behave


def _read_request(sock: socket.socket) -> bytes:
    """The request's head; its body (an upload) read and dropped, so the client is never stuck sending."""
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(65536)
        if not part:
            return data
        data += part
    head, _, rest = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            length = int(value.strip())
    left = length - len(rest)
    while left > 0:
        part = sock.recv(min(left, 65536))
        if not part:
            break
        left -= len(part)
    return head


@contextmanager
def hostile_server(behaviour: Behaviour) -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of a server answering every request with ``behaviour``; stopped on exit."""
    stop = threading.Event()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.01)  # how long stopping waits for the accepting thread
    threads: list[threading.Thread] = []

    def serve(sock: socket.socket) -> None:
        with sock:
            sock.settimeout(SAFETY_S)
            conn = Connection(sock, stop)
            try:
                conn.head = _read_request(sock)
                if conn.head:
                    behaviour(conn)
            except OSError:
                pass

    def accept() -> None:
        while not stop.is_set():
            try:
                sock, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            thread = threading.Thread(target=serve, args=(sock,), daemon=True)
            threads.append(thread)
            thread.start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        acceptor.join(timeout=2)
        listener.close()
        for thread in threads:
            thread.join(timeout=2)
