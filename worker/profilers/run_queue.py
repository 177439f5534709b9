"""A CPU clock for a shared machine: a call's wall time less the time this process's threads spent waiting for a
core, so that a profile taken beside a busy neighbour times the step an idle machine would run.

NOTE [ time beside a neighbour ] On a 2-core VM with a CPU-bound process beside it (a Python process spinning
on a core), torch's two threads and the neighbour share two cores. Every parallel region waits for its slower
thread, so a whole training step took 2.1-3.2x its idle time (``benchmarks/busy_clock.py steps``, ResNet-50,
least of 12 steps at batch 4, 128²: 262-294 ms idle, 838 ms beside the neighbour; of 20 at batch 1, 64²: 70-80
and 170 ms), and every profiled time and plan estimate with it. The least of more rounds does not help:
scheduler slices (1.4 ms here) are shorter than most stages, so no stage runs uncontended. Process CPU time
does not either: OpenMP's threads spin while they wait for each other, so it grows too.

Linux books, per thread, the time it was runnable but not running (``/proc/self/task/<tid>/schedstat``,
second field, in ns; no ``schedstats`` setting needed). A parallel region ends when its slowest thread does,
so the step moves while none of its threads waits. With one thread more runnable than cores (one
neighbour), one thread waits at a time: the step's threads' waits never overlap, and the step ran for its wall
time less their sum. The same steps so timed beside the neighbour: least 272.5 ms at batch 4, 128², 80.3 ms at
batch 1, 64²: the idle machine's, which they are taken for. With more threads runnable the waits overlap, and
:func:`unwaited_ms` takes the waiting ones to be any of the runnable threads alike (the two rules agree at one
extra thread). That is rougher: beside two or three spinning processes, or a torch process of two threads,
the steps' least came out 2-35% below the idle one at batch 4, 128² and 18-68% at batch 1, 64²; their medians
-35% to +1% off the idle median; on the wall clock 1.9-9.6x above it. On an idle machine the waits are 1-2% of
a step and the clock is the wall clock. Figures and the profiles they give: docs/benchmarks.md ("Step time").

Which rule applies is counted, not inferred. The clock used to read the number of runnable threads off the
waits (each of three threads waits a third of the time beside one neighbour), but a neighbour does not take
its fair share: on this VM's kernel (6.18) one spinning process beside ResNet-152 at batch 4, 128² slowed
its steps 7-14x (4.1-8.4 s, leasts and medians, against 550-617 ms idle) with waits of 87-94% of the call,
which read as more than one neighbour, and the overlap rule left 913-1,642 ms; wall less waits, the
one-neighbour rule, left 430-567. So the clock counts the neighbours as each call starts and
ends (:func:`runnable_elsewhere`: ``/proc/loadavg``'s runnable threads, less this process's running compute
threads), takes the fewer of the two counts (a kernel thread runnable for an instant is rarely caught twice)
and picks the rule by the count: beside one spinning process the same steps read 561 / 605 ms, least / median,
against 608 / 616 idle (``benchmarks/busy_clock.py steps --model resnet152 --size 4x128 --rounds 6 --loads
spin``). The count is not taken where the process is held to fewer cores than the machine has (a cpuset:
the machine's runnable threads may be on the other cores); there the waits decide as before.

What it cannot do:

- A wait is booked when it ends, whole. A call of a few ms can be charged with a wait that began before it, or
  not yet with one that is still going on, so a short call's time can be off by a slice either way:
  :func:`remat.worker.profilers.step_timing.time_stages` takes stage times from whole passes for that reason.
  Beside a neighbour that takes most of the cores a thread can wait tens of ms at a time, and a whole step's
  time can be off by that: the least of 12 of ResNet-152's steps above, read by the one-neighbour rule, was
  21% below the idle least, their median 0.5% below the idle median.
- A thread that spins (OpenMP, between regions) and is preempted is counted as waiting although nothing
  waited for it. Beside one neighbour that does not matter (the wall less the step's waits is the time the
  neighbour waited, when both of the step's threads ran); beside more it is part of why the rule is rough.
- Other threads of the process (a data loader's pin-memory thread, a heartbeat) are counted too; asleep, they
  wait for nothing. When torch runs more threads than the process has cores, its threads wait for each other,
  which an idle machine would too: the clock is then the wall clock.
- Time the host's hypervisor takes from the VM (steal) is invisible to the guest's scheduler, and a neighbour
  that competes for memory bandwidth or caches rather than cores slows the step without any wait.
- Without the files (not Linux, a kernel built without ``CONFIG_SCHED_INFO``), the clock is the wall clock.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["RunQueueClock", "Timed", "cores", "runnable_elsewhere", "thread_waits_ns", "unwaited_ms"]

TASKS = "/proc/self/task"
LOADAVG = "/proc/loadavg"
"""Its fourth field's numerator is the number of threads runnable on the machine at the moment it is read
(running or queued for a core), the reader included."""


@dataclass(frozen=True, slots=True)
class Timed:
    """One timed call, or the sum of consecutive ones (``+``)."""

    wall_ms: float
    waited_ms: float = 0.0
    """Run-queue waits of the process's threads booked during the call (0 where they cannot be read)."""
    threads: int = 1
    """Compute threads the step runs on (torch's intra-op threads)."""
    cores: int = 1
    """Cores the process may run on."""
    neighbours: float | None = None
    """Threads runnable beside the call's own (:func:`runnable_elsewhere`), counted as it started and as it
    ended, the fewer of the two; over a sum of calls their wall-weighted mean; None where they cannot be
    counted."""

    @property
    def ms(self) -> float:
        """The call's time with the cores it asked for (:func:`unwaited_ms`). For a call of a few ms it can be
        off by a scheduler slice; never below zero."""
        return unwaited_ms(self.wall_ms, self.waited_ms, self.threads, self.cores, self.neighbours)

    def __add__(self, other: Timed) -> Timed:
        wall = self.wall_ms + other.wall_ms
        neighbours = None
        if self.neighbours is not None and other.neighbours is not None:  # the wall-weighted mean
            neighbours = ((self.neighbours * self.wall_ms + other.neighbours * other.wall_ms) / wall if wall > 0
                          else (self.neighbours + other.neighbours) / 2)
        return Timed(wall, self.waited_ms + other.waited_ms, self.threads, self.cores, neighbours)


def unwaited_ms(wall_ms: float, waited_ms: float, threads: int, cores: int,
                neighbours: float | None = None) -> float:
    """What a call of ``wall_ms`` would have taken had none of its ``threads`` waited for one of ``cores``,
    given that they waited ``waited_ms`` in all (NOTE [ time beside a neighbour ]).

    A parallel region of torch ends when its slowest thread does, so the step moves only while all of its
    threads run. With at most one thread more than cores runnable (one neighbour), at most one waits at a
    time: the waits never overlap, and the step ran for ``wall - waited``. With more, waits overlap; taking
    the waiting threads to be any of the runnable ones alike, the share of time none of the step's threads
    waits is ``prod((cores - j) / (runnable - j) for j < threads)``. ``runnable`` is ``threads + neighbours``
    where the neighbours were counted; otherwise the number of threads competing that makes each wait the
    share it did (which reads one neighbour that takes more than its share of the cores as more than one).
    The two rules agree at one thread more than cores.
    """
    if waited_ms <= 0 or wall_ms <= 0 or threads < 1 or threads > cores:
        return max(wall_ms, 0.0)
    if neighbours is not None:
        runnable = threads + max(neighbours, 0.0)
    else:
        waiting = min(waited_ms / (threads * wall_ms), 0.99)  # each thread's share of the call spent waiting
        runnable = cores / (1.0 - waiting)
    if runnable <= cores + 1:
        return max(wall_ms - waited_ms, 0.0)
    running = 1.0
    for j in range(threads):
        running *= (cores - j) / (runnable - j)
    return wall_ms * running


_open: dict[str, int] = {}
"""Thread id -> an open descriptor of its ``schedstat``: reading it again costs a ``pread`` (11 µs a call for
three threads, listing included, against 56 µs opening each file anew), which every timed call pays twice."""
_running_fds: dict[str, int] = {}
"""Thread id -> an open descriptor of its ``stat`` (the thread's state), kept as for ``schedstat``."""
_open_lock = threading.Lock()


def _pread_kept(kept: dict[str, int], tid: str, name: str) -> bytes | None:
    """The thread's ``/proc`` file ``name`` read through a descriptor kept open in ``kept``; None where it cannot
    be read (the thread ended)."""
    fd = kept.get(tid)
    for _ in range(2):  # a descriptor of a thread that ended (its id since reused) is opened again, once
        if fd is None:
            try:
                fd = kept[tid] = os.open(f"{TASKS}/{tid}/{name}", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None
        try:
            text = os.pread(fd, 512, 0)
        except OSError:
            text = b""
        if text:
            return text
        os.close(kept.pop(tid))
        fd = None
    return None


def _read_wait(tid: str) -> int | None:
    text = _pread_kept(_open, tid, "schedstat")
    try:
        return int(text.split()[1]) if text is not None else None
    except (IndexError, ValueError):
        return None


def _thread_ids() -> list[str] | None:
    """This process's thread ids, the kept descriptors of threads that ended (or of a forked parent's) closed;
    the caller holds ``_open_lock``."""
    try:
        tids = os.listdir(TASKS)
    except OSError:
        return None
    listed = set(tids)
    for kept in (_open, _running_fds):
        for gone in kept.keys() - listed:
            os.close(kept.pop(gone))
    return tids


def _waits(tids: list[str]) -> dict[str, int] | None:
    waits = {tid: ns for tid in tids if (ns := _read_wait(tid)) is not None}
    return waits or None


def thread_waits_ns() -> dict[str, int] | None:
    """Run-queue wait so far, in ns, of every thread of this process (by thread id); None where Linux's
    per-thread scheduler statistics cannot be read. A thread that ends between the listing and its read is
    left out."""
    with _open_lock:
        tids = _thread_ids()
        return _waits(tids) if tids is not None else None


def cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _running(tid: str) -> bool:
    text = _pread_kept(_running_fds, tid, "stat")
    if text is None or b")" not in text:
        return False
    return text[text.rindex(b")") + 2:][:1] == b"R"  # the name in parentheses may hold anything


def _elsewhere(tids: list[str], threads: int) -> int | None:
    try:
        with open(LOADAVG, "rb") as f:
            machine = int(f.read().split()[3].split(b"/")[0])
    except (OSError, IndexError, ValueError):
        return None
    ours = sum(_running(tid) for tid in tids)
    return max(machine - min(ours, threads), 0)


def _countable(available: int) -> bool:
    """Whether the machine's runnable threads compete for this process's cores: not where it is held to fewer
    cores than the machine has (a cpuset, a container), whose neighbours may run on cores it never runs on."""
    return available == os.cpu_count()


def runnable_elsewhere(threads: int) -> int | None:
    """Threads runnable on this machine now besides this process's running compute threads (at most
    ``threads`` of its running ones; others of its own, a data loader's, compete like a neighbour's); None
    where the count cannot be read or cannot be told apart by core (:func:`_countable`)."""
    if not _countable(cores()):
        return None
    with _open_lock:
        tids = _thread_ids()
        return _elsewhere(tids, threads) if tids is not None else None


def _sample(threads: int, count: bool) -> tuple[dict[str, int] | None, int | None]:
    """:func:`thread_waits_ns` and, where ``count``, :func:`runnable_elsewhere`, from one listing of the
    process's threads (every timed call samples twice)."""
    with _open_lock:
        tids = _thread_ids()
        if tids is None:
            return None, None
        waits = _waits(tids)
        return waits, _elsewhere(tids, threads) if count and waits is not None else None


class RunQueueClock:
    """Times calls as :class:`Timed` (NOTE [ time beside a neighbour ]).

    Args:
        compute_threads: how many threads the timed work runs on (torch's intra-op threads), asked at every
            call since a training script may change it. With more threads than cores they wait for each other
            on an idle machine too, and the waits are the step's own: the call is timed on the wall clock.
    """

    def __init__(self, compute_threads: Callable[[], int]) -> None:
        self._compute_threads = compute_threads
        self.readable = thread_waits_ns() is not None
        """Whether this machine books run-queue waits per thread; otherwise every call's ``waited_ms`` is 0."""

    def time(self, fn: Callable[[], Any]) -> Timed:
        """Run ``fn`` once and time it."""
        threads, available = self._compute_threads(), cores()
        timed_waits = self.readable and threads <= available
        before, elsewhere = _sample(threads, _countable(available)) if timed_waits else (None, None)
        start = time.perf_counter_ns()
        fn()
        end = time.perf_counter_ns()
        wall_ms = (end - start) / 1e6
        if before is None:
            return Timed(wall_ms, 0.0, threads, available)
        after, still = _sample(threads, elsewhere is not None)
        after = after or {}
        # The fewer of the two counts: a thread runnable for an instant (a kernel worker, a timer) is rarely
        # caught twice, a neighbour that keeps a core busy always is.
        neighbours = min(elsewhere, still) if elsewhere is not None and still is not None else None
        # A thread born during the call has waited only within it: its count starts at 0.
        waited = sum(max(0, ns - before.get(tid, 0)) for tid, ns in after.items())
        return Timed(wall_ms, waited / 1e6, threads, available, neighbours)
