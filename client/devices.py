"""The device classes remat profiles on, and how a profiling queue names its device: the one list.

Every place that accepts a device by name derives from :data:`DEVICES`: ``ModelRequest``, the CLI's
``--device`` choice, the service's request schemas and its queue pattern. The worker keeps one profiling
backend per name (``remat.worker.profilers.BACKENDS``, tested to match), so a new device is a name here and
a backend there. Plain data: the client's light modules import it, so it must never import torch.

Public API::

    DEVICES = ("cpu", "cuda")
    ONE_JOB_PER_PROCESS            # devices whose worker process is replaced after every job
    QUEUE_PATTERN                  # a profiling queue: a device, optionally narrowed (cuda-h100)
    queue_device("cuda-h100") -> "cuda"
    unavailable_reason("cuda") -> "torch sees no CUDA device" | None   # imports torch
"""

from __future__ import annotations

import re

__all__ = ["DEVICES", "ONE_JOB_PER_PROCESS", "QUEUE_PATTERN", "queue_device", "unavailable_reason"]

DEVICES = ("cpu", "cuda")
"""Device classes (``torch.device(...).type``) that remat profiles, plans and measures on."""

ONE_JOB_PER_PROCESS = frozenset({"cuda"})
"""Devices whose worker replaces its process after every job: the device's caching allocator keeps what a job
reserved until the process exits, and the next model may need all of it. A name-level fact, so that the
worker's parent process decides it without importing torch (CUDA and fork do not mix)."""

QUEUE_PATTERN = "(" + "|".join(re.escape(d) for d in DEVICES) + r")(-[a-z0-9][a-z0-9_.-]{0,39})?"
"""A profiling queue: the device class, optionally narrowed to a GPU model after a dash (``cuda-h100``), so
that a job can ask for a kind of GPU while its request still names only the device class."""


def queue_device(queue: str) -> str:
    """The device class a profiling queue serves: the part before the first dash (``cuda-h100`` → ``cuda``)."""
    return queue.split("-", 1)[0]


def unavailable_reason(device: str) -> str | None:
    """Why this machine cannot run ``device`` (``torch sees no CUDA device``); None when it can.

    One answer for the client's model building and the worker's backends: an accelerator is usable when
    torch's module of that name says so (``torch.cuda``, ``torch.mps``, ``torch.xpu`` share the face), so a
    new device needs nothing here. Imports torch, when called.
    """
    if device == "cpu":
        return None
    import torch

    accelerator = getattr(torch, device, None)
    if accelerator is not None and accelerator.is_available():
        return None
    return f"torch sees no {device.upper()} device"
