"""Run ``remat-client`` in-process and capture what a user would see."""

from __future__ import annotations

import contextlib
import io

import pytest

from remat.client.cli import main


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``remat-client ARGS`` (``main`` always ends in SystemExit)."""
    with pytest.raises(SystemExit) as info:
        main(list(args))
    out, err = capsys.readouterr()
    return int(info.value.code), out, err


def run_cli_with_store(database_url: str, *args: str) -> tuple[int, str]:
    """Exit code and stdout of ``remat-client ARGS`` on the store at ``database_url``, where no ``capsys`` is at
    hand (a module-scoped fixture filling a store once for the tests that read it)."""
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), pytest.raises(SystemExit) as info:
        patch.setenv("REMAT_DATABASE_URL", database_url)
        main(list(args))
    return int(info.value.code), out.getvalue()
