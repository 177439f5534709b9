"""The CUDA timeline's replay and marks (remat.worker.allocator_history), without a GPU.

The allocator's history is read through ``torch.cuda.memory._snapshot()``; here a stand-in keeps entries in
that documented format (``device_traces[i]``: dicts with ``action`` and ``size``) and, like the real
allocator, logs a ``snapshot`` entry each time one is taken. What the real allocator records is checked on
a GPU by tests/worker/test_measure.py's CUDA timeline test.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from remat.worker.allocator_history import AllocatorHistory, allocated_levels


class FakeAllocator:
    """The two private torch.cuda.memory calls AllocatorHistory makes, over an in-memory ring buffer."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = [{"action": "alloc", "size": 999}]  # an earlier recording's
        self.recording = False
        self.max_entries = 0
        self.calls: list[tuple[Any, dict[str, Any]]] = []

    def record(self, enabled: str | None = "all", context: str | None = "all", stacks: str = "all",
               max_entries: int = 1 << 62, clear_history: bool = False) -> None:
        self.calls.append((enabled, {"context": context, "max_entries": max_entries,
                                     "clear_history": clear_history}))
        self.recording = enabled is not None
        self.max_entries = max_entries
        if clear_history:
            self.entries = []

    def event(self, action: str, size: int) -> None:
        if self.recording:
            self.entries.append({"action": action, "size": size, "addr": 0, "stream": 0, "frames": []})
            del self.entries[:-self.max_entries]  # the ring buffer keeps the newest max_entries

    def snapshot(self) -> dict[str, Any]:
        self.event("snapshot", 0)
        return {"segments": [], "device_traces": [list(self.entries)]}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeAllocator:
    fake = FakeAllocator()
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", fake.record)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", fake.snapshot)
    return fake


def test_levels_count_allocs_and_requested_frees_only() -> None:
    entries = [{"action": "segment_alloc", "size": 2 << 20}, {"action": "alloc", "size": 512},
               {"action": "alloc", "size": 100}, {"action": "free_requested", "size": 512},
               {"action": "free_completed", "size": 512}, {"action": "snapshot", "size": 0},
               {"action": "free_requested", "size": 700}, {"action": "segment_free", "size": 2 << 20}]
    # The 700-byte block was allocated before recording began: the level goes below where it started.
    assert allocated_levels(entries) == [512, 612, 100, -600]
    assert allocated_levels([]) == []


def test_marks_become_sample_indices_and_recording_stops(fake: FakeAllocator) -> None:
    history = AllocatorHistory(torch.device("cuda", 0), max_entries=100)
    history.start()
    assert fake.calls[0] == ("all", {"context": None, "max_entries": 100, "clear_history": True})
    fake.event("alloc", 1000)
    fake.event("segment_alloc", 1 << 21)
    fake.event("alloc", 300)
    mark = history.position()  # after two allocs: backward starts at sample 2
    fake.event("free_requested", 300)
    fake.event("free_completed", 300)
    fake.event("alloc", 50)
    levels, (at,) = history.stop(mark)
    assert levels == [1000, 1300, 1000, 1050]
    assert at == 2 and levels[:at] == [1000, 1300]
    assert fake.calls[-1][0] is None and not fake.recording, "recording is off after stop"
    history.close()
    assert len(fake.calls) == 2, "close after stop does nothing"


def test_an_earlier_recording_is_left_out_even_without_clear_history(fake: FakeAllocator,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def record(enabled: str | None = "all", context: str | None = "all", max_entries: int = 1 << 62) -> None:
        fake.recording, fake.max_entries = enabled is not None, max_entries  # an older torch: no clear_history

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    history = AllocatorHistory(torch.device("cuda", 0), max_entries=100)
    history.start()
    fake.event("alloc", 10)
    levels, _ = history.stop()
    assert levels == [10], "the 999-byte alloc of an earlier recording is not replayed"


def test_a_wrapped_ring_buffer_gives_no_timeline(fake: FakeAllocator) -> None:
    history = AllocatorHistory(torch.device("cuda", 0), max_entries=8)
    history.start()
    for _ in range(10):
        fake.event("alloc", 1)
    assert history.stop() == (None, [])
    assert not fake.recording

