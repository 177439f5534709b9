"""Fixtures the client's tests share."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty plan cache and local store; no ambient service."""
    monkeypatch.setenv("REMAT_DATABASE_URL", f"sqlite:///{tmp_path / 'local.sqlite'}")
    for name in ("REMAT_SERVER", "REMAT_API_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "plans"
