"""Work that runs beside a copy: one background thread for the checks a copy must wait on.

A put checks its payload for NaN / Inf and a host read checks each page's digest. Either check
is one more pass over the bytes the copy moves; run in line, it adds its whole time to the call.
Here it runs on a second thread while the calling thread copies (both release the GIL: torch's
reductions and xxhash's digests do), and the call waits on its result before anything it wrote
becomes visible. One thread per process, started on first use (and again in a forked child);
its tasks are leaves (a reduction, a digest): they never submit work of their own nor take a
lock of the cache, so waiting on one under the cache's lock cannot deadlock.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pid = 0


def beside(fn: Callable[..., T], *args) -> Future[T]:
    """``fn(*args)`` on the background thread; the future holds its result or its exception."""
    global _pool, _pid
    with _lock:
        if _pool is None or _pid != os.getpid():
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmtier-beside")
            _pid = os.getpid()
        return _pool.submit(fn, *args)


def settle(fut: Future | None) -> None:
    """Wait for a future whose result is no longer wanted (its work reads memory a caller is
    about to reuse or release); its exception, if any, is dropped."""
    if fut is not None:
        try:
            fut.result()
        except BaseException:   # noqa: BLE001 - the result was abandoned; only completion matters
            pass
