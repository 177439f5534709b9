"""Run ``remat-client`` in-process and capture what a user would see."""

from __future__ import annotations

import pytest

from remat.client.cli import main


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``remat-client ARGS`` (``main`` always ends in SystemExit)."""
    with pytest.raises(SystemExit) as info:
        main(list(args))
    out, err = capsys.readouterr()
    return int(info.value.code), out, err
