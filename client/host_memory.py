"""glibc's malloc set to keep the memory a CPU training step frees, so that remat's own processes time steps
without the page faults of giving it back.

NOTE [ page faults on CPU ] On CPU torch allocates through ``malloc``. glibc serves a large block from fresh
``mmap`` pages and returns freed memory at the top of its heap to the system; both thresholds move with what
the process freed before (glibc's dynamic thresholds). So a step can fault in again, page by page, tens of
megabytes it freed a moment before, and how many depends on the sizes and order of everything the process
allocated until then. Measured on this project's 2-core VM (``benchmarks/host_faults.py``, docs/benchmarks.md
"Page faults on CPU"): ViT-B/16 at batch 1, 64², gradients kept, faulted 15,000-25,000 pages (60-100 MB) per
training step under glibc's defaults; the least of the same step differed between runs by up to 65 ms
(``none``: 132 and 197 ms), and one segment over stages 1-13 cost 78% of one over 1-32 in one run and 28% in
the next. With the thresholds fixed (mmap above 32 MiB, the largest glibc accepts; trim above 2 GiB, the
largest ``mallopt``'s int holds) the steps faulted no page, each plan's overhead grew with the stages it
re-runs, and ``none`` ran 6% faster (124-126 ms).

remat's own processes that time steps — the ``remat-client`` commands and the Celery workers — call
:func:`keep_freed_memory` at their start, so that the profile's stage times and every measured step time are
the step's own work. A training script's process is the user's: ``remat.client.checkpoint`` profiling on a
miss does not change its allocator (a trace records which way it was timed: ``timing.host_malloc``). The same
setting is the environment ``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=2147483647`` (docs/apply.md),
for a CPU training process that wants those faults gone; where either is set, it is left as set.

The price: the process keeps the memory it freed (up to its peak of small and mid-sized blocks) instead of
returning it to the system, as CUDA's caching allocator does on a GPU. Where the C library is not glibc, nothing
changes.
"""

from __future__ import annotations

import os
import platform

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "host_malloc", "keep_freed_memory"]

MMAP_THRESHOLD = 32 * 2**20
"""Blocks above this come from ``mmap`` still: glibc refuses a larger threshold on 64-bit (``HEAP_MAX_SIZE / 2``)."""
TRIM_THRESHOLD = 2**31 - 1
"""Free memory at the heap's top beyond this goes back to the system: in practice, none of a step's."""
ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
"""glibc's own variables for the same settings, read once at the process's start."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_state: str | None = None


def _glibc() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def keep_freed_memory() -> str:
    """Fix glibc's mmap and trim thresholds for this process (NOTE [ page faults on CPU ]); idempotent. Returns
    :func:`host_malloc`'s answer afterwards."""
    global _state
    current = host_malloc()
    if current != "glibc defaults":  # already kept, the user's own setting, or no glibc to set
        return current
    import ctypes

    libc = ctypes.CDLL(None)
    ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    _state = "kept" if ok else None
    return host_malloc()


def host_malloc() -> str:
    """How this process's ``malloc`` was set when steps were timed: ``kept`` (:func:`keep_freed_memory`),
    ``set by environment``, ``glibc defaults`` or ``not glibc``."""
    if _state is not None:
        return _state
    if any(name in os.environ for name in ENVIRONMENT):
        return "set by environment"
    return "glibc defaults" if _glibc() else "not glibc"
