"""The CPU clock that books run-queue waits (remat.worker.profilers.run_queue), against the scheduler itself: a
neighbour pinned to the core the timed call is pinned to takes about half of it, which the clock must book as
waited; a call that sleeps waits for nothing."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

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


@contextlib.contextmanager
def spinning_neighbour(setup: str = "") -> Iterator[None]:
    """Another Python process spinning on a core (``setup`` run first) for the block, started and spinning."""
    neighbour = subprocess.Popen([sys.executable, "-c", f"{setup}\nwhile True: pass"])
    try:
        time.sleep(0.3)
        yield
    finally:
        neighbour.kill()
        neighbour.wait()


@linux_only
def test_a_neighbour_on_the_same_core_is_booked_as_waiting(one_core: int) -> None:
    with spinning_neighbour(f"import os; os.sched_setaffinity(0, {{{one_core}}})"):
        timed = RunQueueClock(lambda: 1).time(lambda: spin(0.4))
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


def test_a_counted_neighbour_is_one_whatever_the_waits_say() -> None:
    """One neighbour that takes more than its third of two cores: one of three threads still waits at a time,
    so the step moved for the wall time less its threads' waits. From the waits alone (each thread 45% of the
    call) the clock would take it for more than one neighbour and leave more."""
    assert unwaited_ms(1000.0, 900.0, 2, 2, neighbours=1.0) == pytest.approx(100.0)
    assert unwaited_ms(1000.0, 900.0, 2, 2) > 150.0
    assert unwaited_ms(300.0, 400.0, 2, 2, neighbours=4.0) == pytest.approx(300.0 / 15)
    assert unwaited_ms(300.0, 200.0, 2, 2, neighbours=0.0) == pytest.approx(100.0)  # waits, whoever caused them


@given(wall=st.floats(1.0, 1e4), waited=st.floats(0.0, 4e4), threads=st.integers(1, 8), extra=st.integers(0, 8),
       neighbours=st.none() | st.floats(0.0, 16.0))
def test_the_unwaited_time_with_counted_neighbours_stays_within_the_wall(wall: float, waited: float, threads: int,
                                                                        extra: int, neighbours: float | None) -> None:
    cores = threads + extra
    got = unwaited_ms(wall, waited, threads, cores, neighbours)
    assert 0.0 <= got <= wall
    assert unwaited_ms(wall, waited * 1.1 + 1.0, threads, cores, neighbours) <= got + 1e-9


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
    counted = Timed(100.0, 30.0, 2, 2, neighbours=1.0) + Timed(50.0, 40.0, 2, 2, neighbours=4.0)
    assert counted.neighbours == pytest.approx(2.0)  # weighted by wall time
    assert (Timed(100.0, 30.0, 2, 2, neighbours=1.0) + Timed(50.0, 40.0, 2, 2)).neighbours is None


def _fake_loadavg(tmp_path: Path, running: int) -> str:
    path = tmp_path / "loadavg"
    path.write_text(f"0.50 0.40 0.30 {running}/321 4242\n")
    return str(path)


@linux_only
def test_neighbours_are_the_machine_s_runnable_threads_less_the_call_s_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread that counts is running, so of five runnable threads four are someone else's; a process's
    running threads beyond its compute threads count as neighbours."""
    monkeypatch.setattr(run_queue, "LOADAVG", _fake_loadavg(tmp_path, 5))
    monkeypatch.setattr(run_queue, "cores", lambda: os.cpu_count())
    assert run_queue.runnable_elsewhere(1) == 4
    assert 0 <= run_queue.runnable_elsewhere(64) <= 4  # however many of this process's threads run now
    monkeypatch.setattr(run_queue, "LOADAVG", _fake_loadavg(tmp_path, 0))
    assert run_queue.runnable_elsewhere(1) == 0  # never below zero


@linux_only
def test_neighbours_are_not_counted_on_part_of_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Held to fewer cores than the machine has, the machine's runnable threads may run on the others."""
    monkeypatch.setattr(run_queue.os, "cpu_count", lambda: run_queue.cores() + 1)
    assert run_queue.runnable_elsewhere(1) is None
    assert RunQueueClock(lambda: 1).time(lambda: spin(0.005)).neighbours is None


@linux_only
def test_a_spinning_neighbour_is_counted() -> None:
    with spinning_neighbour():
        timed = RunQueueClock(lambda: 1).time(lambda: spin(0.05))
    if run_queue.cores() != os.cpu_count():  # held to part of the machine: not counted
        assert timed.neighbours is None
    else:
        assert timed.neighbours is not None and timed.neighbours >= 1, timed  # other test processes may run too
