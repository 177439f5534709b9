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

__all__ = ["cpu_backend", "profile_cpu"]


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _born_in_pass(meter: Any, t: torch.Tensor) -> bool:
    return meter.is_followed(t)


def _time_ms(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def cpu_backend() -> Backend:
    """Readings for CPU: :class:`MemoryMeter`, storage ``nbytes``, ``time.perf_counter``."""
    return Backend(device=torch.device("cpu"), make_meter=MemoryMeter, storage_bytes=_nbytes,
                   born_in_pass=_born_in_pass, time_ms=_time_ms, device_name=cpu_name())


def profile_cpu(chain: StageChainLike, model: nn.Module, example_input: torch.Tensor, **kwargs: Any) -> Trace:
    """Profile on CPU; keyword arguments as :func:`remat.worker.profilers.common.profile_chain`."""
    return profile_chain(chain, model, example_input, backend=cpu_backend(), **kwargs)
