"""Files a user names (``plan --trace FILE``, ``evaluate --checkpoints-file``, ``REMAT_CONFIG``), read whole
only up to a limit.

A command that reads a file whole reads whatever it is given: a 20 GB file named by mistake was read into
memory until the OOM killer ended it (issue 31). Each reader states the most its file can sensibly hold, and
:func:`read_limited` refuses more before reading it — from the file's size when it has one, and by reading at
most one byte past the limit when it has none (a FIFO, ``/dev/zero``, a file still growing).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["FileTooLargeError", "read_limited", "size_text"]


class FileTooLargeError(ValueError):
    """A file larger than its reader's limit; the message says how large (when known) and the limit."""

    def __init__(self, size: int | None, limit: int, what: str) -> None:
        how_large = f"{size_text(size)}, more" if size is not None else "more"
        super().__init__(f"{how_large} than the {size_text(limit)} {what} may be")
        self.size = size
        self.limit = limit


def size_text(n: int) -> str:
    """``67108864`` → ``64 MiB``; ``67108865`` → ``67108865 bytes (64.0 MiB)``: a size just past a limit must not
    read as the limit itself."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n // scale} {unit}" if n % scale == 0 else f"{n} bytes ({n / scale:.1f} {unit})"
    return f"{n} bytes"


def read_limited(path: str | os.PathLike[str], limit: int, what: str) -> bytes:
    """The bytes of ``path``, at most ``limit`` of them; ``what`` names such a file in the error (``a trace
    file``).

    Raises:
        FileTooLargeError: the file is (or turns out, reading it) larger than ``limit``; nothing more is read.
        OSError: the file cannot be opened or read.
    """
    with Path(path).open("rb") as f:
        info = os.fstat(f.fileno())
        if stat.S_ISREG(info.st_mode) and info.st_size > limit:
            raise FileTooLargeError(info.st_size, limit, what)
        data = f.read(limit + 1)
    if len(data) > limit:
        raise FileTooLargeError(None, limit, what)
    return data
