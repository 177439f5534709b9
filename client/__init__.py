"""remat's light side: trace and plan schemas, and (lazily, because they need torch) apply() and friends.

``import remat.client`` must stay cheap and torch-free so that planning from a trace file starts fast;
names that need torch are resolved on first access (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["apply", "checkpoint", "fetch_and_apply", "fetch_plan", "Plan", "PlanServiceClient", "Trace", "load_trace"]

_LAZY = {
    "apply": ("remat.client.apply_plan", "apply"),
    "checkpoint": ("remat.client.plan_lookup", "checkpoint"),
    "fetch_and_apply": ("remat.client.fetch", "fetch_and_apply"),
    "fetch_plan": ("remat.client.fetch", "fetch_plan"),
    "PlanServiceClient": ("remat.client.service_client", "PlanServiceClient"),
    "Plan": ("remat.client.plan", "Plan"),
    "Trace": ("remat.client.trace", "Trace"),
    "load_trace": ("remat.client.trace", "load_trace"),
}


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'remat.client' has no attribute {name!r}") from None
    return getattr(importlib.import_module(module), attr)
