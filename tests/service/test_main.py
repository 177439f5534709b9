"""The remat-service command: migrate, current, downgrade (serving is covered by the benchmark)."""

from __future__ import annotations

import pytest

from remat.service.main import main
from remat.service.migrate import HEAD_REVISION


def test_migrate_current_downgrade(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                   sqlite_url: str) -> None:
    monkeypatch.setenv("REMAT_DATABASE_URL", sqlite_url)
    assert main(["current"]) == 0
    assert capsys.readouterr().out.strip().endswith(": base")
    assert main(["migrate"]) == 0
    assert capsys.readouterr().out.strip().endswith(f": {HEAD_REVISION}")
    assert main(["downgrade", "--revision", "base"]) == 0
    assert capsys.readouterr().out.strip().endswith(": base")


def test_unreachable_database_is_exit_1(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("REMAT_DATABASE_URL", "postgresql://nobody:secret@127.0.0.1:9/remat")
    assert main(["migrate"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("remat-service: database postgresql+psycopg://nobody:***@127.0.0.1:9/remat")
    assert "secret" not in err


def test_bad_configuration_is_exit_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("REMAT_PORT", "not-a-port")
    assert main(["current"]) == 2
    assert "port" in capsys.readouterr().err
