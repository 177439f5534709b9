"""Files a user names are read whole only up to a limit (issue 31, finding 6): ``plan --trace`` of a 20 GB
file was read until the OOM killer ended it. Past its limit a file is refused with exit 2 and one line naming
the file and the limit — before it is read when it has a size, after limit + 1 bytes when it has none.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from remat.client.cli_plan import MAX_CHECKPOINTS_FILE_BYTES
from remat.client.config import MAX_CONFIG_FILE_BYTES
from remat.client.trace import MAX_TRACE_FILE_BYTES
from tests.utils.cli import run_cli

SCRIPT = str(Path(sys.executable).parent / "remat-client")
MEMORY_LIMIT = 1 << 30
"""The address space the CLI gets below: a command that read a 20 GiB file whole would fail (MemoryError), not
take the machine's memory."""


def _sparse(path: Path, size: int) -> Path:
    """A file of ``size`` bytes that takes no disk (a hole): what a 20 GB file costs to make here."""
    with path.open("wb") as f:
        f.truncate(size)
    return path


def _limited_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


@pytest.mark.parametrize("command", ["plan", "evaluate"])
def test_a_20_gb_trace_file_is_refused_before_it_is_read(tmp_path: Path, command: str) -> None:
    big = _sparse(tmp_path / "big.json", 20 * 2**30)
    sets = tmp_path / "sets.txt"
    sets.write_text("\n")
    args = ["plan", "--trace", str(big)] if command == "plan" else [
        "evaluate", "--trace", str(big), "--cost-model", "pytorch", "--checkpoints-file", str(sets)]
    result = subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=120,
                            preexec_fn=_limited_memory)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1
    assert f"'{big}': 20 GiB, more than the 64 MiB a trace file may be" in result.stderr, result.stderr


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[tuple[Path, list[int]]]:
    """A named pipe with no size, a writer pushing ``MAX_TRACE_FILE_BYTES + 1 MiB`` of spaces into it; yields
    the path and, once it is done, how many bytes the reader took."""
    path = tmp_path / "trace.fifo"
    os.mkfifo(path)
    written: list[int] = []

    def write() -> None:
        sent = 0
        try:
            with path.open("wb") as f:
                block = b" " * 2**20
                while sent < MAX_TRACE_FILE_BYTES + 2**20:
                    f.write(block)
                    sent += len(block)
        except BrokenPipeError:
            pass
        written.append(sent)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    yield path, written
    # The writer may still be waiting for a reader, writing, or just ending on a broken pipe. A blocking open
    # here hung the suite when the writer ended between a liveness check and the open (no writer left to
    # pair with): open without blocking and drain until the writer is gone.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        deadline = time.monotonic() + 10
        while writer.is_alive() and time.monotonic() < deadline:
            try:
                os.read(fd, 2**20)
            except BlockingIOError:
                time.sleep(0.01)
    finally:
        os.close(fd)
    writer.join(timeout=10)


def test_a_trace_without_a_size_is_read_no_further_than_the_limit(capsys: pytest.CaptureFixture[str],
                                                                 fifo: tuple[Path, list[int]]) -> None:
    path, _ = fifo
    code, out, err = run_cli(capsys, "plan", "--trace", str(path))
    assert code == 2 and out == ""
    assert f"'{path}': more than the 64 MiB a trace file may be" in err and err.count("\n") == 1, err


def test_a_checkpoints_file_past_its_limit_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    trace.write_text('{"format": "remat-trace/1", "input_bytes": 1, "stages": [{"name": "a", "output_bytes": 1, '
                     '"saved_bytes": 1}, {"name": "b", "output_bytes": 1, "saved_bytes": 1}]}')
    sets = _sparse(tmp_path / "sets.txt", MAX_CHECKPOINTS_FILE_BYTES + 1)
    code, _, err = run_cli(capsys, "evaluate", "--trace", str(trace), "--cost-model", "pytorch",
                           "--checkpoints-file", str(sets))
    assert code == 2 and err.count("\n") == 1
    assert (f"--checkpoints-file '{sets}': 16777217 bytes (16.0 MiB), more than the 16 MiB a checkpoints file "
            "may be") in err, err


def test_a_config_file_past_its_limit_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    config = _sparse(tmp_path / "config.toml", MAX_CONFIG_FILE_BYTES + 1)
    monkeypatch.setenv("REMAT_CONFIG", str(config))
    code, _, err = run_cli(capsys, "config", "show")
    assert code == 2 and err.count("\n") == 1
    assert f"config file {config}: 1048577 bytes (1.0 MiB), more than the 1 MiB a config file may be" in err, err


def test_read_limited_reads_limit_plus_one_bytes_of_an_endless_file() -> None:
    from remat.client.user_files import FileTooLargeError, read_limited

    with pytest.raises(FileTooLargeError, match=r"^more than the 4 KiB a test file may be$") as info:
        read_limited("/dev/zero", 4096, "a test file")
    assert info.value.size is None and info.value.limit == 4096
    assert read_limited(__file__, 2**20, "a test file") == Path(__file__).read_bytes()
