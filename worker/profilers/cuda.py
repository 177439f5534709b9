"""CUDA profiler: the caching allocator's own counters and CUDA events.

Memory is what ``torch.cuda.memory_allocated`` reports (what decides an out-of-memory error), peaks are
``max_memory_allocated`` after ``reset_peak_memory_stats``; ``memory_reserved`` is recorded beside it.
A storage is booked at the allocator's block granularity (512 bytes) so that d_i and e_i speak the same
unit as the measured peaks. Two allocator effects stay outside any trace: a large block is not split when
less than 1 MiB would remain (up to 1 MiB more per tensor), and cached-but-free memory (``reserved``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from remat.client.trace import Trace
from remat.worker.allocator_history import AllocatorHistory
from remat.worker.profilers.common import Backend, StageChainLike, profile_chain
from remat.worker.profilers.run_queue import Timed

__all__ = ["CudaBackend", "CudaMeter", "profile_cuda"]

ALLOCATOR_BLOCK = 512


def allocator_bytes(t: torch.Tensor) -> int:
    """A storage's size rounded up to the caching allocator's 512-byte blocks."""
    n = t.untyped_storage().nbytes()
    return -(-n // ALLOCATOR_BLOCK) * ALLOCATOR_BLOCK


class CudaMeter:
    """The :class:`~remat.worker.memory_meter.MemoryMeter` interface over the CUDA caching allocator.

    Peak resets are global to the device (``reset_peak_memory_stats``), so only one meter may be in use at
    a time, which the profilers and ``measure_step`` guarantee.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self._baseline = 0
        self.label: str | None = None
        self._history: AllocatorHistory | None = None

    @property
    def current_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    @property
    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    @property
    def reserved_bytes(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    @property
    def peak_reserved_bytes(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    @property
    def baseline_bytes(self) -> int:
        return self._baseline

    @property
    def peak_above_baseline(self) -> int:
        return self.peak_bytes - self._baseline

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def mark_baseline(self) -> int:
        torch.cuda.synchronize(self.device)
        self._baseline = self.current_bytes
        self.reset_peak()
        return self._baseline

    # -- memory over time: the allocator's history (remat.worker.allocator_history) -----------------------
    timeline_sample = "allocator event"
    """One timeline sample: the bytes requested from the allocator after one alloc or free."""

    def start_timeline(self) -> None:
        """Record the allocator's events from now on (requested bytes; one sample per alloc or free)."""
        history = AllocatorHistory(self.device)
        try:
            history.start()
        except (AttributeError, TypeError, RuntimeError) as exc:  # a torch without this private API
            warnings.warn(f"no CUDA memory timeline: the allocator's history could not be recorded ({exc})",
                          RuntimeWarning, stacklevel=2)
            return
        self._history = history

    def timeline_position(self) -> int:
        """A mark for :meth:`stop_timeline`: events recorded so far (a host-side snapshot, no allocation)."""
        return self._history.position() if self._history is not None else 0

    def stop_timeline(self, *marks: int) -> tuple[list[int] | None, list[int]]:
        """Levels above the level at ``start_timeline`` after each event, and each mark as a sample index."""
        if self._history is None:
            return None, []
        history, self._history = self._history, None
        return history.stop(*marks)

    def __enter__(self) -> CudaMeter:
        torch.cuda.synchronize(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize(self.device)
        if self._history is not None:  # an error mid-step: never leave the process recording
            self._history.close()
            self._history = None


class CudaBackend(Backend):
    """Readings for one CUDA device: the caching allocator's counters, 512-byte blocks, CUDA events."""

    name = "cuda"
    warm_up_first = True
    meter_counts_resident = True
    fixed_memory = True

    def __init__(self, device: torch.device | str | None = None) -> None:
        dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        super().__init__(dev, torch.cuda.get_device_name(dev))

    def make_meter(self) -> CudaMeter:
        return CudaMeter(self.device)

    def storage_bytes(self, t: torch.Tensor) -> int:
        return allocator_bytes(t)

    def born_in_pass(self, meter: Any, t: torch.Tensor) -> bool:
        return True

    def timed(self, fn: Callable[[], Any]) -> Timed:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(self.device)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return Timed(float(start.elapsed_time(end)), 0.0)

    def device_rng_state(self) -> object:
        return torch.cuda.get_rng_state_all()

    def set_device_rng_state(self, state: object) -> None:
        torch.cuda.set_rng_state_all(state)  # type: ignore[arg-type]  # what device_rng_state returned

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def reserved_bytes(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def peak_reserved_bytes(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    def requested_bytes(self, which: Literal["current", "peak"]) -> int:
        return int(torch.cuda.memory_stats(self.device).get(f"requested_bytes.all.{which}", 0))

    def allocated_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def capacity_bytes(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory


def profile_cuda(chain: StageChainLike, model: nn.Module, example_input: torch.Tensor, *,
                 device: torch.device | str | None = None, **kwargs: Any) -> Trace:
    """Profile on a CUDA device; keyword arguments as :func:`remat.worker.profilers.common.profile_chain`."""
    return profile_chain(chain, model, example_input, backend=CudaBackend(device), **kwargs)
