"""The CPU clock that books run-queue waits (remat.worker.profilers.run_queue), against the scheduler itself: a
neighbour pinned to the core the timed call is pinned to takes about half of it, which the clock must book as
waited; a call that sleeps waits for nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from remat.worker.profilers import run_queue
from remat.worker.profilers.cpu import CpuBackend
from remat.worker.profilers.run_queue import RunQueueClock, Timed, unwaited_ms

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or run_queue.thread_waits_ns() is None,
                                reason="per-thread scheduler statistics are Linux's (/proc/self/task/*/schedstat)")


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.fixture
def one_core() -> Iterator[int]:
    """This thread pinned to one core for the test (the affinity restored after)."""
    before = os.sched_getaffinity(0)
    core = min(before)
    os.sched_setaffinity(0, {core})
    try:
        yield core
    finally:
        os.sched_setaffinity(0, before)


@linux_only
def test_a_neighbour_on_the_same_core_is_booked_as_waiting(one_core: int) -> None:
    code = f"import os; os.sched_setaffinity(0, {{{one_core}}})\nwhile True: pass"
    neighbour = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.3)  # started and spinning
        timed = RunQueueClock(lambda: 1).time(lambda: spin(0.4))
    finally:
        neighbour.kill()
        neighbour.wait()
    share = timed.waited_ms / timed.wall_ms
    assert 0.2 < share < 0.8, timed  # half, give or take the scheduler and whatever else runs on the core
    assert 0 < timed.ms < timed.wall_ms


@linux_only
def test_a_call_that_sleeps_waits_for_nothing(one_core: int) -> None:
    timed = RunQueueClock(lambda: 1).time(lambda: time.sleep(0.05))
    assert timed.wall_ms >= 50 and timed.waited_ms < 10, timed


def test_more_compute_threads_than_cores_time_the_wall() -> None:
    """Threads that outnumber the cores wait for each other on an idle machine too: nothing is subtracted."""
    timed = RunQueueClock(lambda: 10**6).time(lambda: spin(0.01))
    assert timed.waited_ms == 0 and timed.ms == timed.wall_ms >= 10


def test_without_scheduler_statistics_the_clock_is_the_wall(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_queue, "TASKS", "/nonexistent/task")
    clock = RunQueueClock(lambda: 1)
    timed = clock.time(lambda: spin(0.01))
    assert not clock.readable and timed.waited_ms == 0 and timed.ms == timed.wall_ms


def test_the_cpu_backend_times_with_it() -> None:
    backend = CpuBackend()
    assert backend.clock.readable == (run_queue.thread_waits_ns() is not None)
    assert backend.time_ms(lambda: spin(0.005)) >= 0


def test_one_neighbour_on_two_cores_takes_what_the_threads_waited() -> None:
    """Two threads and one neighbour on two cores: one of three waits at a time, each a third of the call, and
    the step moves while neither of its threads waits (a third of it)."""
    assert unwaited_ms(300.0, 0.0, 2, 2) == 300.0
    assert unwaited_ms(300.0, 200.0, 2, 2) == pytest.approx(100.0)
    assert unwaited_ms(300.0, 120.0, 2, 2) == pytest.approx(180.0)  # a neighbour that runs part of the time


def test_more_neighbours_overlap_the_waits() -> None:
    """Two threads and four other runnable ones on two cores: four of six wait at a time, so the step's two
    threads both run a fifteenth of the time (choose the two running among six: one pair in fifteen), though
    their waits add up to more than the call."""
    assert unwaited_ms(300.0, 400.0, 2, 2) == pytest.approx(300.0 / 15)
    assert unwaited_ms(300.0, 200.0, 1, 2) == pytest.approx(100.0)  # one thread: whatever it waited


@given(wall=st.floats(1.0, 1e4), waited=st.floats(0.0, 4e4), threads=st.integers(1, 8), extra=st.integers(0, 8))
def test_the_unwaited_time_never_exceeds_the_wall_or_goes_below_zero(wall: float, waited: float, threads: int,
                                                                       extra: int) -> None:
    cores = threads + extra
    got = unwaited_ms(wall, waited, threads, cores)
    assert 0.0 <= got <= wall
    assert unwaited_ms(wall, waited * 1.1 + 1.0, threads, cores) <= got + 1e-9  # more waiting, less left


@given(threads=st.integers(1, 4), extra=st.integers(0, 4))
def test_the_two_regimes_meet_at_one_thread_more_than_cores(threads: int, extra: int) -> None:
    cores = threads + extra
    at = 1000.0 * threads / (cores + 1)  # each thread waits 1/(cores + 1): one of cores + 1 waits at a time
    assert unwaited_ms(1000.0, at * 0.999999, threads, cores) == pytest.approx(
        unwaited_ms(1000.0, at * 1.000001, threads, cores), rel=1e-4)


def test_consecutive_calls_add_up() -> None:
    total = Timed(100.0, 30.0, 2, 2) + Timed(50.0, 40.0, 2, 2)
    assert total == Timed(150.0, 70.0, 2, 2) and total.ms == pytest.approx(80.0)
