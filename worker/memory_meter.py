"""An exact meter of live tensor storage bytes on CPU (or any device without a caching allocator).

Why not RSS or the allocator: the cost model speaks of tensors, and on CPU nothing else reports tensor
memory exactly and repeatably. The meter is a ``TorchDispatchMode`` that sees every aten op, starts
following each storage an op creates, and stops when that storage dies (``weakref.finalize`` on the
untyped storage; since torch 2.x a storage's Python object lives exactly as long as the storage, so the
finalizer fires at the storage's death and not when our reference goes away).

NOTE [ meter exactness ] — two ways a naive meter goes wrong (both found in a first version), handled here:

1. A storage grown in place (``out=`` into an empty tensor, ``resize_``, ``set_``) would stay at the size it
   had when it was first seen. After every op, each argument the schema marks as written
   (``alias_info.is_write``) is measured again and the difference booked.
2. An op may return a tensor sharing an input's storage without an alias annotation (or a view of a
   storage born before the meter started). An output whose storage is already followed, or is one of the
   op's input storages, is never counted as new.

Limits: it counts storages made by aten ops while it is active (not RSS, not allocator slack or kernel
workspaces), on one device type. Storages born before it started are the baseline and are not followed,
except for growth of such a storage through an in-place op, which is booked as new bytes.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["MemoryMeter", "storage_key"]


def storage_key(t: torch.Tensor) -> int | None:
    """Identity of a tensor's storage (the C++ StorageImpl address), None if it has no plain storage.

    Two tensors share memory iff their keys are equal; a key is reused only after its storage died.
    """
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # sparse, nested or wrapper-subclass tensors
        return None


class _Ledger:
    """The counts, kept apart from the mode so that finalizers of storages that outlive it stay cheap."""

    __slots__ = ("sizes", "current", "peak", "high", "__weakref__")

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}
        """Followed storage key -> bytes booked for it (its size, or its growth for a pre-existing one)."""
        self.current = 0
        self.peak = 0
        self.high = 0
        """Highest level since the last timeline sample (so that the timeline's maximum is the peak)."""

    def add(self, key: int, nbytes: int) -> None:
        self.sizes[key] = self.sizes.get(key, 0) + nbytes
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current
        if self.current > self.high:
            self.high = self.current

    def release(self, key: int) -> None:
        self.current -= self.sizes.pop(key, 0)


def _release(ledger_ref: weakref.ref[_Ledger], key: int) -> None:
    ledger = ledger_ref()
    if ledger is not None:
        ledger.release(key)


class MemoryMeter(TorchDispatchMode):
    """Live and peak bytes of the tensor storages created while the meter is active.

    Use as a context manager. ``current_bytes`` and ``peak_bytes`` count from zero at construction;
    ``mark_baseline()`` lets a caller measure "peak above what was alive at this point", which is how
    activation memory is defined (docs/cost-model.md, "What is counted"): parameters, the input batch and
    pre-existing gradients are the baseline.

    Example:
        >>> with MemoryMeter() as meter:
        ...     a = torch.ones(256)           # 1 KiB
        ...     b = a * 2                     # 1 KiB more
        ...     del b
        >>> meter.current_bytes, meter.peak_bytes
        (1024, 2048)

    Args:
        device_type: only storages on this device type are followed (``"cpu"`` by default).
    """

    def __init__(self, device_type: str = "cpu") -> None:
        super().__init__()
        self.device_type = device_type
        self._ledger = _Ledger()
        self._ledger_ref = weakref.ref(self._ledger)
        self._baseline = 0
        self.label: str | None = None
        """Free-form tag (stage name, phase) copied into ``peak_label`` whenever a new peak is reached."""
        self.peak_label: str | None = None
        self.peak_op: str | None = None
        """The aten op whose outputs set the current peak: where the peak is, for diagnostics."""
        self.timeline: list[int] | None = None
        """After ``start_timeline``: per aten op, the highest level above the baseline since the op before."""

    # -- readings ---------------------------------------------------------------------------------------
    @property
    def current_bytes(self) -> int:
        """Bytes of followed storages alive now."""
        return self._ledger.current

    @property
    def peak_bytes(self) -> int:
        """Highest ``current_bytes`` since construction or the last ``reset_peak``/``mark_baseline``."""
        return self._ledger.peak

    @property
    def baseline_bytes(self) -> int:
        """``current_bytes`` at the last ``mark_baseline`` (0 before any)."""
        return self._baseline

    @property
    def peak_above_baseline(self) -> int:
        return self._ledger.peak - self._baseline

    @property
    def current_above_baseline(self) -> int:
        return self._ledger.current - self._baseline

    @property
    def num_storages(self) -> int:
        """How many storages are followed right now."""
        return len(self._ledger.sizes)

    def reset_peak(self) -> None:
        """Start a new peak window at the current level."""
        self._ledger.peak = self._ledger.current
        self.peak_label = self.label
        self.peak_op = None

    timeline_sample = "aten op"
    """One timeline sample: the highest level of live storage bytes since the aten op before."""

    def start_timeline(self) -> None:
        """Record memory over time from now on: one sample per aten op (``timeline``)."""
        self.timeline = []
        self._ledger.high = self._ledger.current

    def restart_high(self) -> None:
        """Let the next timeline sample start from the current level: the first sample of a new peak window must
        not carry the highest level of the ops before it (``profilers.common._Levels``)."""
        self._ledger.high = self._ledger.current

    def timeline_position(self) -> int:
        """A mark for :meth:`stop_timeline`: samples recorded so far."""
        return len(self.timeline) if self.timeline is not None else 0

    def stop_timeline(self, *marks: int) -> tuple[list[int] | None, list[int]]:
        """Stop recording; the samples (highest level above the baseline per aten op) and the marks.

        The same interface as the CUDA meter's, whose marks need translating; here a mark is a sample index.
        """
        samples, self.timeline = self.timeline, None
        return samples, list(marks)

    def mark_baseline(self) -> int:
        """Take the current level as the baseline and reset the peak; returns the baseline in bytes."""
        self._baseline = self._ledger.current
        self.reset_peak()
        return self._baseline

    def is_followed(self, t: torch.Tensor) -> bool:
        """True when the tensor's storage was born (or grew) under this meter and is still alive."""
        key = storage_key(t)
        return key is not None and key in self._ledger.sizes

    # -- bookkeeping ------------------------------------------------------------------------------------
    def _tensors(self, tree: Any) -> Iterator[torch.Tensor]:
        leaves, _ = tree_flatten(tree)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.device.type == self.device_type:
                yield leaf

    def _follow(self, t: torch.Tensor, key: int, nbytes: int) -> None:
        ledger = self._ledger
        if key not in ledger.sizes:
            weakref.finalize(t.untyped_storage(), _release, self._ledger_ref, key)
        ledger.add(key, nbytes)

    def _written(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """Tensors the op's schema says it writes (``Tensor(a!)``), including ``out=`` arguments."""
        written: list[torch.Tensor] = []
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            if arg.kwarg_only or i >= len(args):
                value = kwargs.get(arg.name)
            else:
                value = args[i]
            written.extend(self._tensors(value))
        return written

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        written = self._written(func, args, kwargs)
        before: dict[int, int] = {}
        for t in written:
            key = storage_key(t)
            if key is not None:
                before[key] = t.untyped_storage().nbytes()
        input_keys = {storage_key(t) for t in self._tensors((args, kwargs))}
        out = func(*args, **kwargs)
        ledger = self._ledger
        peak_before = ledger.peak
        # Fix 1: storages written in place may have changed size (resize_, out= into an empty tensor).
        for t in written:
            key = storage_key(t)
            if key is None:
                continue
            nbytes = t.untyped_storage().nbytes()
            if key in ledger.sizes:
                # Followed: book the change. A storage swapped in by set_ that we follow is already booked.
                if key in before:
                    ledger.add(key, nbytes - before[key])
            elif key in before:
                # Born before the meter, grown in place: the growth is new memory.
                if nbytes > before[key]:
                    self._follow(t, key, nbytes - before[key])
            elif key not in input_keys:
                self._follow(t, key, nbytes)
        # Fix 2: an output sharing a followed storage or one of the op's input storages is not new.
        for t in self._tensors(out):
            key = storage_key(t)
            if key is None or key in ledger.sizes or key in input_keys:
                continue
            self._follow(t, key, t.untyped_storage().nbytes())
        if ledger.peak > peak_before:
            self.peak_op = str(func)
            self.peak_label = self.label
        if self.timeline is not None:
            self.timeline.append(ledger.high - self._baseline)
            ledger.high = ledger.current
        return out
