"""The suite's loopback guard (tests/loopback_guard.py): what it lets through, and that it refuses the rest
before a packet could leave. The real connect is replaced by a recorder, so no test here sends anything."""

from __future__ import annotations

import socket

import pytest

from tests import loopback_guard


@pytest.mark.parametrize("host", ["127.0.0.1", "127.45.6.7", "::1", "::ffff:127.0.0.1", "localhost"])
def test_loopback_hosts_pass(host: str) -> None:
    assert loopback_guard.is_loopback(host)


@pytest.mark.parametrize("host", ["10.255.255.1", "192.168.1.1", "172.16.0.1", "192.0.2.1", "2001:db8::1",
                                  "::ffff:10.0.0.1", "0.0.0.0"])
def test_other_hosts_are_not_loopback(host: str) -> None:
    assert not loopback_guard.is_loopback(host)


def test_a_connection_outside_loopback_is_refused_recorded_and_never_attempted(monkeypatch: pytest.MonkeyPatch) -> None:
    attempted: list[object] = []
    monkeypatch.setattr(loopback_guard, "_real_connect", lambda sock, address: attempted.append(address))
    monkeypatch.setattr(loopback_guard, "_real_connect_ex", lambda sock, address: attempted.append(address) or 0)
    seen = len(loopback_guard.violations)
    with socket.socket() as sock:
        with pytest.raises(ConnectionRefusedError, match="loopback only"):
            sock.connect(("192.0.2.1", 9))
        with pytest.raises(ConnectionRefusedError):
            sock.connect_ex(("10.255.255.1", 9))
        sock.connect(("127.0.0.1", 9))  # goes through to the (recording) real connect
    assert attempted == [("127.0.0.1", 9)]
    assert loopback_guard.violations[seen:] == ["192.0.2.1:9", "10.255.255.1:9"]
    del loopback_guard.violations[seen:]  # refused on purpose here: the suite's fixture must not fail this test


def test_unix_sockets_are_not_checked(tmp_path: object) -> None:
    with socket.socket(socket.AF_UNIX) as sock, pytest.raises(FileNotFoundError):
        sock.connect(f"{tmp_path}/no-such-socket")
