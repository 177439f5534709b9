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

STEPS = """
import json, resource, sys, torch
from remat.client import host_memory
state = host_memory.keep_freed_memory() if sys.argv[1] == "kept" else host_memory.host_malloc()
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
for p in model.parameters():
    p.grad = torch.zeros_like(p)  # kept gradients: each backward makes and frees a 4 MiB weight gradient per layer
x = torch.randn(4, 1024)
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    model(x).sum().backward()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"state": state, "again": host_memory.keep_freed_memory() if sys.argv[1] == "kept" else None,
                  "faults": faults}))
"""


def _run(mode: str, **env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
    done = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, timeout=120,
                          env=environment, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@glibc
def test_kept_memory_is_not_faulted_in_again_where_glibc_would() -> None:
    """Every step frees 32 MiB of weight gradients. Under glibc's defaults the later steps fault at least 16 MiB of
    it in again (the premise: were that gone, the setting would be moot); kept, under 1 MiB in all."""
    default = _run("default")
    kept = _run("kept")
    assert default["state"] == "glibc defaults"
    assert kept["state"] == kept["again"] == "kept"
    assert sum(default["faults"][6:]) * 4096 >= 16 * 2**20, default
    assert sum(kept["faults"][6:]) * 4096 < 2**20, kept


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
