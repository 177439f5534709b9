"""CPU profiler: the exact live-storage meter (:mod:`remat.worker.memory_meter`) and wall-clock time.

On CPU there is no caching allocator, so "memory" is the bytes of live tensor storages: exact and
repeatable, which is what the cost model is calibrated against (docs/cost-model.md, Calibration).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from remat.client.trace import Trace
from remat.worker.memory_meter import MemoryMeter
from remat.worker.profilers.common import Backend, StageChainLike, cpu_name, profile_chain

__all__ = ["CpuBackend", "profile_cpu"]


class CpuBackend(Backend):
    """Readings for CPU: :class:`MemoryMeter`, storage ``nbytes``, ``time.perf_counter``.

    No caching allocator: memory is the bytes of live tensor storages, exact, so no reserved or requested
    readings; the process's memory is the host's, so no ``--budget fit``.
    """

    name = "cpu"

    def __init__(self, device: torch.device | str | None = None) -> None:
        # ``device`` only for the registry's one constructor call: there is one CPU, ``cpu:0`` included.
        super().__init__(torch.device("cpu"), cpu_name())

    def make_meter(self) -> MemoryMeter:
        return MemoryMeter()

    def storage_bytes(self, t: torch.Tensor) -> int:
        return t.untyped_storage().nbytes()

    def born_in_pass(self, meter: Any, t: torch.Tensor) -> bool:
        return meter.is_followed(t)

    def time_ms(self, fn: Callable[[], Any]) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    @property
    def rng_devices(self) -> tuple[torch.device, ...]:
        return ()  # the CPU generator is always forked


def profile_cpu(chain: StageChainLike, model: nn.Module, example_input: torch.Tensor, **kwargs: Any) -> Trace:
    """Profile on CPU; keyword arguments as :func:`remat.worker.profilers.common.profile_chain`."""
    return profile_chain(chain, model, example_input, backend=CpuBackend(), **kwargs)
