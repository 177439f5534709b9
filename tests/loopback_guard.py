"""Tests address loopback only: a guard on every connection the test process opens.

A test that needs a dead or hanging service uses a closed loopback port or a loopback listener that never
answers, never a private or public address "that nothing answers" (such traffic leaves the machine). The guard
wraps ``socket.socket.connect`` and ``connect_ex`` (what httpx, redis-py, kombu and asyncio connect through):
an IP connection to anything outside 127.0.0.0/8 and ::1 is refused before a packet is sent, and recorded, so
that the test fails at teardown even when the code under test swallows the error (``checkpoint()`` turns an
unreachable service into a warning). Connections made by C libraries (libpq) and by subprocesses are not seen.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

violations: list[str] = []
"""Every refused connection, ``host:port``, in order (the suite's fixture fails the test that made one)."""

_real_connect = socket.socket.connect
_real_connect_ex = socket.socket.connect_ex


def _loopback_ip(text: str) -> bool:
    ip = ipaddress.ip_address(text.split("%", 1)[0])  # a scoped IPv6 address carries its interface
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` means is a loopback address (a name is resolved first)."""
    try:
        return _loopback_ip(host)
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return True  # a name nothing resolves: the connection cannot leave the machine either
    return all(_loopback_ip(str(info[4][0])) for info in infos)


def _check(sock: socket.socket, address: Any) -> None:
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return  # Unix sockets and the like never leave the machine
    host, port = str(address[0]), address[1]
    if not is_loopback(host):
        violations.append(f"{host}:{port}")
        raise ConnectionRefusedError(f"tests address loopback only; refused a connection to {host}:{port}")


def _connect(self: socket.socket, address: Any) -> None:
    _check(self, address)
    return _real_connect(self, address)


def _connect_ex(self: socket.socket, address: Any) -> int:
    _check(self, address)
    return _real_connect_ex(self, address)


def install() -> None:
    """Guard every socket of this process (idempotent)."""
    socket.socket.connect = _connect  # type: ignore[method-assign]
    socket.socket.connect_ex = _connect_ex  # type: ignore[method-assign]
