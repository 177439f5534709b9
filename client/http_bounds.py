"""What one exchange with a server may cost the client: a whole-request deadline and a cap on the answer's size.

httpx's timeout bounds each socket operation, not a request: a server that sends one byte every 2 s never trips
a 10 s read timeout and holds the request (and the training job waiting on it) as long as it likes — in the
headers too, which h11 buffers up to 64 KiB of before any code of ours sees a byte — and a 200 that never ends
is read into memory until the process dies. So:

- **The deadline** is enforced where every byte passes: the network backend through which httpcore's
  connection pool connects, writes and reads. Inside :func:`deadline_scope`, each of those operations gets the
  time left in the scope as its timeout (or its own, if shorter), and none starts once the scope has ended; it
  then fails with httpcore's timeout error, which httpx maps to its own. Scopes nest: an inner one never ends
  after its enclosing one, so several requests (``checkpoint()``'s lookup) can share one deadline.
- **The cap**: :func:`read_capped` reads an answer's body chunk by chunk and stops past ``limit`` bytes (at
  once when ``Content-Length`` says so), checking the deadline between chunks as well (a transport without
  sockets, such as httpx's ``MockTransport``, is bounded by this check alone).

The backend is not a parameter of httpx's transport: :func:`install` wraps the backend of each connection pool
a client holds (its transport and any proxy mounts), which are private attributes of the httpx and httpcore
versions uv.lock pins. A client whose pools cannot be found is left with the between-chunks check only, and
tests/client/test_hostile_server.py fails on a server that trickles its headers.

A host name's resolution (``getaddrinfo``) has no timeout in the standard library and is not bounded here.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import httpcore
import httpx

__all__ = ["AnswerTooLargeError", "deadline_scope", "install", "read_capped", "time_left"]

_DEADLINE: ContextVar[float | None] = ContextVar("remat_http_deadline", default=None)
"""The monotonic instant the current scope ends (None: no scope). A context variable, so that threads (each
with its own context) sharing one client keep their own deadlines."""

_WRITE_SLICE = 64 * 1024
"""A write is sent in slices of this size, each with the time then left: httpcore's own write loop reuses one
timeout for every ``send`` of a buffer, so a server that accepts a large upload slowly could stretch it."""


class AnswerTooLargeError(Exception):
    """An answer's body is longer than the cap; the message says how long and what the cap is."""


@contextmanager
def deadline_scope(seconds: float) -> Iterator[float]:
    """Everything sent and read inside ends ``seconds`` from now, or when an enclosing scope ends if that is
    sooner; yields the monotonic instant it ends."""
    end = time.monotonic() + seconds
    outer = _DEADLINE.get()
    if outer is not None:
        end = min(end, outer)
    token = _DEADLINE.set(end)
    try:
        yield end
    finally:
        _DEADLINE.reset(token)


def time_left() -> float | None:
    """Seconds left in the current scope (≤ 0 once it has ended), or None outside any scope."""
    end = _DEADLINE.get()
    return None if end is None else end - time.monotonic()


def _cut(timeout: float | None, error: type[Exception]) -> float | None:
    """``timeout`` cut to the scope's time left; ``error`` when none is left."""
    left = time_left()
    if left is None:
        return timeout
    if left <= 0:
        raise error("the request's deadline has passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    """A connection whose every operation ends by the scope's deadline."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _cut(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        view = memoryview(buffer)
        while view:
            piece, view = view[:_WRITE_SLICE], view[_WRITE_SLICE:]
            self._inner.write(bytes(piece), _cut(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.start_tls(ssl_context, server_hostname,
                                                     _cut(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    """The pool's own backend, its connections wrapped in :class:`_DeadlineStream`."""

    def __init__(self, inner: httpcore.NetworkBackend) -> None:
        self._inner = inner

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.connect_tcp(host, port, _cut(timeout, httpcore.ConnectTimeout),
                                                       local_address, socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.connect_unix_socket(path, _cut(timeout, httpcore.ConnectTimeout),
                                                               socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def install(client: httpx.Client) -> bool:
    """Bound every connection ``client`` opens by the scope's deadline (module docstring); returns whether
    each of its transports that has a connection pool could be reached (False: a transport of another kind,
    or an httpx whose internals moved)."""
    transports = [getattr(client, "_transport", None), *getattr(client, "_mounts", {}).values()]
    reached = True
    for transport in transports:
        if transport is None or isinstance(transport, httpx.MockTransport):
            continue
        pool = getattr(transport, "_pool", None)
        backend = getattr(pool, "_network_backend", None)
        if not isinstance(backend, httpcore.NetworkBackend):
            reached = False
            continue
        if not isinstance(backend, _DeadlineBackend):
            pool._network_backend = _DeadlineBackend(backend)  # type: ignore[union-attr]
    return reached


def read_capped(response: httpx.Response, limit: int) -> bytes:
    """The body of a response opened with ``stream=True``, as sent (no decoding), at most ``limit`` bytes.

    Raises:
        AnswerTooLargeError: ``Content-Length`` or the bytes read pass ``limit``.
        httpx.ReadTimeout: the scope's deadline passed between two chunks.
        httpx.HTTPError: what reading raised (a timeout inside a read, a connection closed early...).
    """
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise AnswerTooLargeError(f"an answer of {int(declared)} bytes, more than the {limit} the client reads")
    if response.is_stream_consumed:  # a transport that answered from memory (httpx.MockTransport) read it already
        if len(response.content) > limit:
            raise AnswerTooLargeError(f"an answer longer than the {limit} bytes the client reads")
        return response.content
    chunks: list[bytes] = []
    size = 0
    for chunk in response.iter_raw():
        size += len(chunk)
        if size > limit:
            raise AnswerTooLargeError(f"an answer longer than the {limit} bytes the client reads")
        chunks.append(chunk)
        left = time_left()
        if left is not None and left <= 0:
            raise httpx.ReadTimeout("the request's deadline passed while the answer was still coming",
                                    request=response.request)
    return b"".join(chunks)
