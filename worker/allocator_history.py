"""Memory over time on CUDA, from the caching allocator's own history of allocations and frees.

Why the allocator's history and not a dispatch-mode meter as on CPU: on CUDA the caching allocator decides
what a step holds (``memory_allocated`` is what runs a GPU out of memory), and it already records every
block it hands out and takes back when ``torch.cuda.memory._record_memory_history`` is on — at a few
microseconds per event, with no effect on what is allocated. Replaying those events gives the level after
each one; its maximum is the step's peak of *requested* bytes (the entries carry the size the caller asked
for, before the 512-byte rounding and unsplit large blocks that ``max_memory_allocated`` includes), which
is the ``requested_activation_bytes`` a CUDA measurement records beside the allocated peak.

The history is a process-wide ring buffer. :class:`AllocatorHistory` records without stack traces (small
entries), clears what an earlier recording left, marks positions by the number of entries recorded so far
(a mid-step snapshot), and refuses to build a timeline when the ring buffer wrapped (entries lost).

The replay itself (:func:`allocated_levels`) is a pure function of the documented snapshot format
(``torch.cuda.memory._snapshot``'s ``device_traces``), so it is tested without a GPU; the recording is
tested on one (``@pytest.mark.cuda``).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["AllocatorHistory", "allocated_levels", "MAX_HISTORY_ENTRIES"]

MAX_HISTORY_ENTRIES = 2_000_000
"""Ring-buffer size while measuring: a ResNet-152 step at batch 32 makes tens of thousands of events; an
entry without stack frames is about a hundred bytes, so the bound caps host memory near 200 MB."""

ALLOC = "alloc"
FREE = "free_requested"
"""The allocator books a block as no longer allocated when its free is *requested* (``memory_allocated``
drops then); ``free_completed`` follows once other streams are done with it."""


def allocated_levels(entries: Iterable[Mapping[str, Any]]) -> list[int]:
    """Requested bytes allocated after each ``alloc``/``free_requested`` event, relative to the first event.

    Other actions (segment allocations, snapshots, completed frees, out-of-memory reports) change no
    allocated byte and give no sample. A free of a block allocated before the history began lowers the
    level below zero, as it lowers ``memory_allocated`` below the level when recording started.

    Example:
        >>> allocated_levels([{"action": "alloc", "size": 512}, {"action": "segment_alloc", "size": 2 << 20},
        ...                   {"action": "alloc", "size": 1024}, {"action": "free_requested", "size": 512},
        ...                   {"action": "free_completed", "size": 512}])
        [512, 1536, 1024]
    """
    level = 0
    levels: list[int] = []
    for entry in entries:
        action = entry.get("action")
        if action == ALLOC:
            level += int(entry["size"])
        elif action == FREE:
            level -= int(entry["size"])
        else:
            continue
        levels.append(level)
    return levels


def _device_trace(device: torch.device) -> list[dict[str, Any]]:
    snapshot = torch.cuda.memory._snapshot()
    traces = snapshot.get("device_traces") or []
    index = device.index if device.index is not None else torch.cuda.current_device()
    return list(traces[index]) if index < len(traces) else []


class AllocatorHistory:
    """Record one device's allocator events between ``start`` and ``stop``; mark positions in between.

    Example (on a GPU)::

        history = AllocatorHistory(torch.device("cuda", 0))
        history.start()
        forward()
        backward_at = history.position()
        backward()
        levels, backward_at = history.stop(backward_at)   # levels: bytes after each event
    """

    def __init__(self, device: torch.device, max_entries: int = MAX_HISTORY_ENTRIES) -> None:
        self.device = device
        self.max_entries = max_entries
        self._start = 0
        self._recording = False

    def start(self) -> None:
        """Begin recording (clearing earlier history where this torch can)."""
        record = torch.cuda.memory._record_memory_history
        kwargs: dict[str, Any] = {"context": None, "max_entries": self.max_entries}
        if "clear_history" in inspect.signature(record).parameters:
            kwargs["clear_history"] = True
        record("all", **kwargs)
        self._recording = True
        self._start = len(_device_trace(self.device))

    def position(self) -> int:
        """How many of this device's events were recorded so far (a mark for ``stop``)."""
        return len(_device_trace(self.device))

    def stop(self, *marks: int) -> tuple[list[int] | None, list[int]]:
        """Stop recording; return the level after each event and each mark as an index into those levels.

        None instead of the levels when the ring buffer wrapped: the replay would start mid-step.
        """
        entries = _device_trace(self.device)
        self.close()
        if len(entries) >= self.max_entries:
            return None, []
        recorded = entries[self._start:]
        # A mark counts entries of every action; the levels have one sample per alloc or free.
        sampled = [entry.get("action") in (ALLOC, FREE) for entry in recorded]
        samples_before = [sum(sampled[:max(m - self._start, 0)]) for m in marks]
        return allocated_levels(recorded), samples_before

    def close(self) -> None:
        """Stop recording if still on (idempotent; safe on error paths)."""
        if self._recording:
            torch.cuda.memory._record_memory_history(None)
            self._recording = False
