"""A bounded, thread-safe least-recently-used map, for values that are costly to make and never go stale under
their name: the web pages' drawn pictures (named with the version of the rows they were drawn from) and finished
zoo jobs' rows (a finished job never changes)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["LruCache"]

V = TypeVar("V")


class LruCache(Generic[V]):
    """At most ``size`` values; the least recently used go first. Safe to share between the server's threads."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: Hashable) -> V | None:
        with self._lock:
            value = self._items.get(name)
            if value is not None:
                self._items.move_to_end(name)
            return value

    def put(self, name: Hashable, value: V) -> None:
        with self._lock:
            self._items[name] = value
            self._items.move_to_end(name)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get_or_make(self, name: Hashable, make: Callable[[], V]) -> V:
        """The value under ``name``, made (outside the lock: two first callers may both make it) when missing."""
        value = self.get(name)
        if value is None:
            value = make()
            self.put(name, value)
        return value

    def __len__(self) -> int:
        return len(self._items)
