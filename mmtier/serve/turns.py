"""``TurnRunner``: a worker's requests over one cache (a plain class, no Ray).

``worker.TurnWorker`` (the Ray actor that holds a node's pool) answers its requests through
one; a test runs one in-process over a ``TieredKVCache``. Requests are stateless: each carries
its conversation's history, which the engine finds in the cache by key (``model_api.py``), so
nothing is kept here between requests and there is nothing to close, expire or lose. What it
owns: the serial engine's one-request-at-a-time rule, the counts of a request's cluster calls,
and the mapping of a request's failure to an answer.

Requests run concurrently in threads, except on a ``serial`` engine (the transformers chat model
keeps per-turn state), whose requests take the model one at a time (503 ``busy`` after
``turn_wait_s``; nothing ran). A failed request (503 ``capacity``: the cache had no room for
it; 503 ``holder_lost``: cached state it needed was lost) leaves nothing behind but what the
cache holds anyway: the same request sent again, or a shorter one, runs as if it had never
been sent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import contextmanager

from ..errors import BadMediaError, BusyError, CapacityError, MMTierError, UnknownKeyError
from .config import Workers
from .model_api import Item, Turn, TurnEngine
from .protocol import HTTPError

log = logging.getLogger(__name__)


class TurnRunner:
    """Requests of ``engine`` over ``cache`` (a worker's ``HostedCache``, or any
    ``TieredKVCache``). ``calls``: the cluster calls made so far, by kind (a ``RayTransport``'s
    counter; its change over a request is the request's ``traffic``)."""

    def __init__(self, engine: TurnEngine, cache, workers: Workers, *, index: int = 0,
                 node: str = "local", calls: Counter[str] | None = None):
        self.engine, self.cache, self.workers = engine, cache, workers
        self.index, self.node = index, node
        self.calls: Counter[str] = calls if calls is not None else Counter()
        self._serial = threading.Lock()          # a serial engine's one request at a time
        self.answered = 0

    def answer(self, tenant: str, history: Sequence[Turn], items: Sequence[Item],
               max_new_tokens: int) -> tuple[int, dict]:
        """``(status, body)``; ``items`` (and each earlier turn's): ``("text", str)`` or
        ``(request media type, bytes)``; ``history``: earlier turns with their answers' text."""
        try:
            self.engine.check(history, items, max_new_tokens)          # nothing runs on bad input
        except BadMediaError as exc:
            return _error(400, "bad_media", str(exc))
        except MMTierError as exc:                                      # check raises only on bad input
            return _error(400, "bad_request", str(exc))
        again = "nothing of it is kept: send it again"
        try:
            with self._model_turn():
                calls_before = dict(self.calls)
                t0 = time.perf_counter()
                out = self.engine.answer(self.cache, tenant, history, items, max_new_tokens)
                seconds = time.perf_counter() - t0
                traffic = {k: n - calls_before.get(k, 0) for k, n in self.calls.items()
                           if n != calls_before.get(k, 0)}
        except BusyError as exc:                  # nothing ran
            return _error(503, "busy", f"{exc}; {again}")
        except CapacityError as exc:
            return _error(503, "capacity", f"the cache has no room for this request: {exc}; {again}, "
                                           "or a shorter one")
        except UnknownKeyError as exc:            # a holder died mid-request (HolderLostError)
            return _error(503, "holder_lost", f"cached state was lost mid-request: {exc}; {again}")
        except MMTierError as exc:
            log.exception("request failed")
            return _error(500, "internal", f"{type(exc).__name__}: {exc}")
        self.answered += 1
        return 200, {
            "tokens": out.tokens, "text": out.text, "prompt_tokens": out.prompt_tokens,
            "cached_tokens": out.cached_tokens, "node": self.node, "worker": self.index,
            "seconds": round(seconds, 4), "cache": {"counts": out.counts, "traffic": traffic},
        }

    @contextmanager
    def _model_turn(self):
        """The model for one request: alone when the engine is ``serial``, so the request's
        traffic and counts are its own; waited for at most ``turn_wait_s``, else ``BusyError``
        (nothing ran)."""
        if not self.engine.serial:
            yield
            return
        wait = self.workers.turn_wait_s
        if not self._serial.acquire(timeout=wait):
            raise BusyError(f"the model stayed busy with other requests for {wait:g} s")
        try:
            yield
        finally:
            self._serial.release()


def _error(status: int, code: str, message: str) -> tuple[int, dict]:
    return status, HTTPError(status, code, message).body()
