"""Small traces and plans for the service tests, and where the test services live."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import Any

from remat.client.plan import Plan
from remat.client.plan_key import current_torch_version
from remat.client.trace import TRACE_FORMAT, Trace, parse_trace

# Where the test services are; the databases and keys the tests create are their own (see conftest.py).
PG_ADMIN_URL = os.environ.get("REMAT_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("REMAT_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
TOKEN = "test-write-token"
TORCH = current_torch_version()
"""The torch version test traces record: the installed one, as a profiler here would write it."""
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def closed_port_url(scheme: str = "redis") -> str:
    """A URL on a loopback port nothing listens on: connecting fails at once (ECONNREFUSED)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"{scheme}://127.0.0.1:{port}/0"


def trace_dict(*, num_stages: int = 6, model_hash: str | None = "arch-1", input_shape: Sequence[int] = (8, 3, 32, 32),
               dtype: str = "float32", device: str = "cpu", scale: int = 1, **metadata: Any) -> dict[str, Any]:
    """A valid remat-trace/1 object; ``scale`` changes the figures (so the content) but not the key."""
    meta: dict[str, Any] = {"model": "tiny-net", "input_shape": list(input_shape), "dtype": dtype,
                            "device": device, "torch_version": TORCH, **metadata}
    if model_hash is not None:
        meta["model_hash"] = model_hash
    return {
        "format": TRACE_FORMAT, "input_bytes": 4096, **meta,
        "stages": [{"name": f"layer{i}", "output_bytes": 1000 * i * scale, "saved_bytes": 500 * scale,
                    "forward_ms": 0.5 * i, "backward_ms": 1.0 * i} for i in range(1, num_stages + 1)],
    }


def make_trace(**kwargs: Any) -> Trace:
    return parse_trace(trace_dict(**kwargs))


def fixed_plans(trace: Trace, algorithms: Sequence[str] = ("linear", "none"), *,
                checkpoints: tuple[int, ...] = (2,), budget_bytes: int | None = None) -> list[Plan]:
    """Plans without running planners: the repository tests need rows, not good plans."""
    return [Plan(algorithm=a, cost_model="pytorch", checkpoints=checkpoints if a != "none" else (),
                 predicted_peak_bytes=5000, baseline_peak_bytes=9000, num_stages=trace.num_stages,
                 recompute_ms=1.5, step_ms=10.0, budget_bytes=budget_bytes) for a in algorithms]
