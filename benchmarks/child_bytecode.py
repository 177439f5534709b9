"""Fresh interpreters with or without cached bytecode, for the start-up benchmarks.

A start-up figure depends on whether the interpreter finds its modules' bytecode cached. An ordinary install
writes it on first import and reads it afterwards, and remat's Docker image compiles it at build time
(``UV_COMPILE_BYTECODE=1``); this VM sets ``PYTHONDONTWRITEBYTECODE=1``, so every interpreter compiles every
module it imports from source — remat's own modules cost about 4x as much to import that way (GPT-2's hit:
101 ms against 25 ms, docs/benchmarks.md). Leaving it to the environment made the figure depend on which
``__pycache__`` folders earlier commands happened to leave, so each start-up benchmark sets it explicitly:

- compiled from source (the default): ``PYTHONDONTWRITEBYTECODE=1`` and a ``PYTHONPYCACHEPREFIX`` that is an
  empty folder of the run's own, so that no cached bytecode is read either;
- ``--bytecode``: bytecode cached under ``DIR/pycache`` (``PYTHONPYCACHEPREFIX``), written by an untimed run
  before the timed ones.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from tempfile import TemporaryDirectory

__all__ = ["child_environment"]


@contextmanager
def child_environment(cache: str | Path, *, bytecode: bool, **variables: str) -> Iterator[dict[str, str]]:
    """The environment of one child interpreter: this one's, ``variables`` and the bytecode rule above."""
    env = {**os.environ, **variables}
    if bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(Path(cache) / "pycache")
        yield env
        return
    with TemporaryDirectory(prefix="no-bytecode-") as empty:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env["PYTHONPYCACHEPREFIX"] = empty
        yield env
