"""Waiting for a cluster to settle: a predicate polled until true or a bound passes."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(pred: Callable[[], bool], timeout: float, every: float = 0.2) -> bool:
    """``True`` once ``pred()`` is; ``pred()``'s last answer when ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(every)
    return pred()
