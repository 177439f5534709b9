"""Forcing two PostgreSQL transactions into one order with events, never sleeps.

One side stops at a point inside its transaction (:class:`Stop`); the other runs until it has either finished
or is waiting on a lock (``pg_blocking_pids``), and only then is the first let go. Where the code under test
takes the lock, the second side is seen waiting and goes on after the first commits; where it does not, the
second side finishes first and the race the lock prevents happens for sure, not by luck.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from remat.service.db import Database

LIMIT_S = 60.0
"""Only for a broken test: a side that neither finishes nor waits on a lock by then fails it."""


class Stop:
    """A point where a side's transaction stops: ``reached`` once it is there, it goes on after ``go``."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.go = threading.Event()

    def __call__(self) -> None:
        self.reached.set()
        if not self.go.wait(LIMIT_S):
            raise AssertionError("a stopped transaction was never let go")


class Side(threading.Thread):
    """``body(session)`` in a write transaction of its own thread; its backend pid is known before it runs."""

    def __init__(self, db: Database, body: Callable[[Session], Any]) -> None:
        super().__init__(daemon=True)
        self.db, self.body = db, body
        self.pid: int | None = None
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            with self.db.write_session() as session:
                self.pid = session.execute(text("SELECT pg_backend_pid()")).scalar_one()
                self.value = self.body(session)
        except BaseException as exc:  # reported by result(), not lost in the thread
            self.error = exc
        finally:
            self.done.set()

    def result(self) -> Any:
        """Wait for the side to end; its body's value, or what it raised."""
        self.join(LIMIT_S)
        assert self.done.is_set(), "a side did not end"
        if self.error is not None:
            raise self.error
        return self.value


def finished_or_blocked(db: Database, side: Side) -> str:
    """``finished`` once ``side`` has ended, ``blocked`` once it waits on another transaction's lock."""
    deadline = time.monotonic() + LIMIT_S
    with db.engine.connect() as conn:
        while not side.done.wait(0.002):
            if side.pid is not None and conn.execute(text("SELECT cardinality(pg_blocking_pids(:pid)) > 0"),
                                                     {"pid": side.pid}).scalar_one():
                return "blocked"
            conn.rollback()  # the next look is a fresh one
            assert time.monotonic() < deadline, "a side neither finished nor waited on a lock"
    return "finished"
