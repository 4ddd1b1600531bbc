"""``OwnerLock``: the cache's re-entrant lock, which a thread that must wait lets go of entirely.

The cache's lock covers bookkeeping only. Where a call must wait for a copy (a spill to disk
that makes room, a restore), it marks what it works on (``busy`` or ``pins`` of the groups),
lets go of the lock for the wait (``unlocked``), takes it again and re-checks what may have
changed meanwhile. ``unlocked`` releases every level the thread holds, so a wait deep inside a
call never stalls the other threads of the process.
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
        try:
            yield
        finally:
            for _ in range(depth):
                self._lock.acquire()
            self._owner, self._depth = threading.get_ident(), depth
