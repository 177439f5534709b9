"""glibc's malloc kept from giving a step's freed memory back (NOTE [ page faults on CPU ]): each case in a fresh
interpreter, since the setting is the process's and glibc reads its environment once."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="glibc's malloc thresholds: Linux with glibc only")

BLOCK = """
import ctypes, json, sys
from remat.client import host_memory
state = host_memory.keep_freed_memory() if sys.argv[1] == "kept" else host_memory.host_malloc()
again = host_memory.keep_freed_memory() if sys.argv[1] == "kept" else None


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]


libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 20 * 2**20  # the size of a large activation or weight gradient, below glibc's largest mmap threshold
before = libc.mallinfo2()
block = libc.malloc(size)
ctypes.memset(block, 1, size)
held = libc.mallinfo2()
libc.free(block)
after = libc.mallinfo2()
print(json.dumps({"state": state, "again": again, "mapped": held.hblkhd - before.hblkhd,
                  "heap_grew": held.arena - before.arena, "heap_kept": after.arena - before.arena}))
"""


def _run(mode: str, **env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
    done = subprocess.run([sys.executable, "-c", BLOCK, mode], capture_output=True, text=True, timeout=120,
                          env=environment, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@glibc
def test_a_freed_block_stays_in_the_process_where_glibc_would_unmap_it() -> None:
    """A 20 MiB block, read with glibc's own accounting (``mallinfo2``). Under glibc's defaults a fresh process
    serves it from fresh ``mmap`` pages, which ``free`` unmaps: the next such block is faulted in anew (the
    premise). Kept, it comes from the heap, and the heap keeps it after ``free``. (The step-level effect, faults
    per training step, is measured in benchmarks/host_faults.py: glibc's dynamic thresholds make it vary from
    run to run, too much for a test's bound.)"""
    default = _run("default")
    kept = _run("kept")
    assert default["state"] == "glibc defaults"
    assert default["mapped"] >= 20 * 2**20 and default["heap_kept"] < 2**20, default
    assert kept["state"] == kept["again"] == "kept"
    assert kept["mapped"] == 0 and kept["heap_grew"] >= 20 * 2**20 - 2**20, kept
    assert kept["heap_kept"] == kept["heap_grew"], kept


@glibc
def test_the_users_own_setting_is_left_as_set() -> None:
    """Where glibc's own variable is set, the process's allocator is the user's choice: nothing is changed."""
    assert _run("kept", MALLOC_TRIM_THRESHOLD_="131072")["state"] == "set by environment"


def test_a_training_process_is_not_changed_by_importing_the_client() -> None:
    """``remat.client.checkpoint`` runs in the user's training process: importing the client (and asking how the
    allocator stands) changes nothing."""
    probe = ("import remat.client, remat.client.host_memory as h; print(h.host_malloc()); "
             "print(h._state)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True,
                          env={k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")})
    state, internal = done.stdout.strip().splitlines()
    assert internal == "None"
    assert state in ("glibc defaults", "not glibc")
