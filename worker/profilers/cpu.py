"""CPU profiler: the exact live-storage meter (:mod:`remat.worker.memory_meter`) and wall-clock time less the
time the process's threads waited for a core (:mod:`remat.worker.profilers.run_queue`).

On CPU there is no caching allocator, so "memory" is the bytes of live tensor storages: exact and
repeatable, which is what the cost model is calibrated against (docs/cost-model.md, Calibration).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from remat.client.trace import Trace
from remat.worker.memory_meter import MemoryMeter
from remat.worker.profilers.common import Backend, StageChainLike, cpu_name, profile_chain
from remat.worker.profilers.run_queue import RunQueueClock, Timed

__all__ = ["CpuBackend", "profile_cpu"]


class CpuBackend(Backend):
    """Readings for CPU: :class:`MemoryMeter`, storage ``nbytes``, :class:`RunQueueClock` over torch's threads.

    No caching allocator: memory is the bytes of live tensor storages, exact, so no reserved or requested
    readings; the process's memory is the host's, so no ``--budget fit``.
    """

    name = "cpu"

    def __init__(self, device: torch.device | str | None = None) -> None:
        # ``device`` only for the registry's one constructor call: there is one CPU, ``cpu:0`` included.
        super().__init__(torch.device("cpu"), cpu_name())
        self.clock = RunQueueClock(torch.get_num_threads)

    def make_meter(self) -> MemoryMeter:
        return MemoryMeter()

    def storage_bytes(self, t: torch.Tensor) -> int:
        return t.untyped_storage().nbytes()

    def born_in_pass(self, meter: Any, t: torch.Tensor) -> bool:
        return meter.is_followed(t)

    def timed(self, fn: Callable[[], Any]) -> Timed:
        return self.clock.time(fn)

    @property
    def rng_devices(self) -> tuple[torch.device, ...]:
        return ()  # the CPU generator is always forked


def profile_cpu(chain: StageChainLike, model: nn.Module, example_input: torch.Tensor, **kwargs: Any) -> Trace:
    """Profile on CPU; keyword arguments as :func:`remat.worker.profilers.common.profile_chain`."""
    return profile_chain(chain, model, example_input, backend=CpuBackend(), **kwargs)
