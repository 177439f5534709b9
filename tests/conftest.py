"""Suite-wide policy: CUDA tests run only where a GPU is present; services are required under CI=true; every
connection stays on loopback (tests/loopback_guard.py)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
from hypothesis import Phase, settings

from tests import loopback_guard

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# The suite runs in several pytest-xdist processes (addopts: -n 3). Left alone, torch in each of them, and in
# every service, worker and CLI process they start, runs a thread per core: three times as many busy threads as cores,
# whose OpenMP spin-waits slowed CPU-bound tests up to threefold (the README's `plan resnet152` line: 65 s
# alone, 193 s beside the other process). Each process gets its share of the cores instead, through the
# environment so that the processes a test starts get it too. Results do not depend on it: a test compares
# steps run in one process, or in processes started with this same environment.
_PROCESSES = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
if _PROCESSES > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _PROCESSES)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
    if "torch" in sys.modules:  # imported before this file (a plugin): the variable came too late for it
        sys.modules["torch"].set_num_threads(_THREADS)

# Mutation runs (benchmarks/mutation_*.toml) pass --hypothesis-profile=mutation: a failing example only has to
# be found, not shrunk, and shrinking a killed mutant's counterexample would cost most of the run's time.
settings.register_profile("mutation", phases=[Phase.explicit, Phase.reuse, Phase.generate], print_blob=False)

loopback_guard.install()


@pytest.fixture(autouse=True)
def _loopback_only() -> Iterator[None]:
    """Fail the test that opened a connection outside loopback, even if the code under test swallowed the
    refusal."""
    seen = len(loopback_guard.violations)
    yield
    refused = loopback_guard.violations[seen:]
    if refused:
        pytest.fail(f"this test opened connections outside loopback ({', '.join(refused)}); tests address "
                    f"127.0.0.0/8 and ::1 only: use a closed loopback port or a loopback listener that never "
                    f"answers", pytrace=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; run on a lent GPU (device tool)")
    for item in cuda_items:
        item.add_marker(skip)


def require_service(name: str, reachable: bool, detail: str) -> None:
    """Fail under CI when a backing service is missing; skip with the reason elsewhere."""
    if reachable:
        return
    message = f"{name} is not reachable ({detail})"
    if IN_CI:
        pytest.fail(f"{message}; CI requires it (.ci/run starts or installs it)")
    pytest.skip(message)


@pytest.fixture(autouse=True)
def _plan_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """remat.client.checkpoint writes plans to the user's cache directory, and the client reads the user's
    config file: never the real ones in tests."""
    if "REMAT_PLAN_CACHE_DIR" not in os.environ:
        monkeypatch.setenv("REMAT_PLAN_CACHE_DIR", str(tmp_path_factory.mktemp("plan-cache")))
    if "REMAT_CONFIG" not in os.environ:  # a developer's own config file must not steer the tests
        monkeypatch.setenv("REMAT_CONFIG", os.devnull + ".remat-tests-have-no-config.toml")
