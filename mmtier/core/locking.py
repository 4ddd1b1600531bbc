"""``OwnerLock``: the cache's re-entrant lock, which a thread that must wait lets go of entirely.

The cache's lock covers bookkeeping only. Where a call must wait for a copy (a spill to disk
that makes room, a restore), it marks what it works on (``busy`` or ``pins`` of the groups),
lets go of the lock for the wait (``unlocked``), takes it again and re-checks what may have
changed meanwhile. ``unlocked`` releases every level the thread holds, so a wait deep inside a
call never stalls the other threads of the process. A call that needs what other threads hold
for a moment (pages of groups being read or moved) waits with ``wait_change`` until some
thread lets go of the lock, bounded in time, and looks again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class OwnerLock:
    """A re-entrant lock (``with lock:``) that its owner can let go of for a wait."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._owner: int | None = None        # the holding thread (written by it only)
        self._depth = 0                       # levels it holds
        self._changed = threading.Condition(threading.Lock())
        self._generation = 0                  # one more each time the lock is let go entirely

    def __enter__(self) -> OwnerLock:
        self._lock.acquire()
        self._owner = threading.get_ident()
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
            self._lock.release()
            self._notify()
        else:
            self._lock.release()

    @property
    def generation(self) -> int:
        """How many times the lock was let go entirely (read it with the lock held)."""
        return self._generation

    def wait_change(self, seen: int, timeout: float) -> bool:
        """Let go of the lock until another thread has let go of it after ``generation`` was
        ``seen`` (the bookkeeping may have changed), at most ``timeout`` s; ``True`` if so."""
        with self.unlocked(), self._changed:
            return self._changed.wait_for(lambda: self._generation != seen, timeout)

    def _notify(self) -> None:
        with self._changed:
            self._generation += 1
            self._changed.notify_all()

    def held(self) -> bool:
        """Whether the calling thread holds the lock."""
        return self._owner == threading.get_ident()

    @contextmanager
    def unlocked(self) -> Iterator[None]:
        """Let go of every level this thread holds for the block, then take them all back.
        A thread that does not hold the lock passes through unchanged."""
        if not self.held():
            yield
            return
        depth, self._depth, self._owner = self._depth, 0, None
        for _ in range(depth):
            self._lock.release()
        self._notify()
        try:
            yield
        finally:
            for _ in range(depth):
                self._lock.acquire()
            self._owner, self._depth = threading.get_ident(), depth
