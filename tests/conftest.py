"""Suite-wide policy: CUDA tests run only where a GPU is present; services are required under CI=true."""

from __future__ import annotations

import os

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


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
        pytest.fail(f"{message}; CI requires it (.ci/run starts it)")
    pytest.skip(message)
