"""``StoreWriteBehind``: the node store's write-behind (the cluster's side of issue 50).

A group a pool hands to its node store lands in the store's host tier; without this it reached
the store's disk only when the host tier needed room, so a store process killed outright (OOM
killer, node loss: SIGKILL) lost every host group. With ``cfg.write_behind`` and a disk tier,
each group taken into the host tier is also written to disk in the background, once, through the
store's ``Mover`` (the same verified writer as a spill, from the host slots held until written),
so a store recreated over the same directory adopts it and re-registers it.

Policy, as the cache's ``WriteBehind`` (``tiers/durability.py``): a save is queued only while the
bytes not yet written drain within ``HEADROOM`` of ``durable_lag_s`` at the rate the disk was
measured to take (an empty backlog always takes it); else it is dropped (``durable_dropped``) and
written only when the host tier spills it. A write that fails (disk budget, full disk, I/O) is
counted (``durable_write_errors``); serving goes on. It never takes the store's lock: its
done-callbacks run on the mover's thread, which the store may be waiting on; the store reaps
finished writes (``take_done``) under its own lock.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass

from ..config import CacheConfig, ModalitySpec
from ..content import ContentKey
from ..errors import CapacityError, MMTierError
from ..storage import Mover
from ..tiers.durability import FIRST_RATE, HEADROOM, LAG_WINDOW, RATE_WEIGHT

log = logging.getLogger(__name__)
SETTLE_S = 60.0        # bound of a wait for one group's copy in flight (a spill or drop of it)


@dataclass
class _Write:
    future: concurrent.futures.Future
    nbytes: int
    at: float                       # monotonic time of the save
    ok: bool | None = None          # None while in flight


class StoreWriteBehind:
    """Background durable copies of the store's host groups (see the module doc)."""

    def __init__(self, cfg: CacheConfig, mover: Mover, counters: dict[str, int]):
        self.lag_s = cfg.durable_lag_s
        self.mover = mover
        self.counters = counters
        for name in ("durable_writes", "durable_bytes", "durable_dropped", "durable_write_errors"):
            counters.setdefault(name, 0)
        self._lock = threading.Lock()
        self._writes: dict[ContentKey, _Write] = {}
        self._s_per_byte = 1.0 / FIRST_RATE
        self._last_done = 0.0
        self._lags: collections.deque[float] = collections.deque(maxlen=LAG_WINDOW)
        self._logged: set[str] = set()

    def saved(self, key: ContentKey, spec: ModalitySpec, num_tokens: int, nbytes: int) -> None:
        """A group now in the host tier: start its durable copy, or drop it when the disk is behind."""
        with self._lock:
            backlog = sum(w.nbytes for w in self._writes.values() if w.ok is None)
            if backlog and (backlog + nbytes) * self._s_per_byte > HEADROOM * self.lag_s:
                self.counters["durable_dropped"] += 1
                return
        try:
            fut = self.mover.spill(key, spec, num_tokens, None)     # the host copy stays
        except (MMTierError, OSError) as exc:
            self._failed(exc)
            return
        write = _Write(fut, nbytes, time.monotonic())
        with self._lock:
            self._writes[key] = write
        fut.add_done_callback(lambda f, w=write: self._done(w))

    def pending(self, key: ContentKey) -> concurrent.futures.Future | None:
        """The key's durable copy still in flight (or finished and not reaped yet)."""
        with self._lock:
            w = self._writes.get(key)
            return None if w is None else w.future

    def take_done(self) -> list[tuple[ContentKey, bool]]:
        """The writes finished since the last call: ``(key, written)`` each (store lock held)."""
        with self._lock:
            done = [(k, bool(w.ok)) for k, w in self._writes.items() if w.ok is not None]
            for k, _ in done:
                del self._writes[k]
        return done

    def settle(self, key: ContentKey) -> bool:
        """Wait (bounded) for ``key``'s copy in flight and take it: ``True`` if it is on disk now."""
        with self._lock:
            w = self._writes.get(key)
        if w is None:
            return False
        try:
            w.future.result(timeout=SETTLE_S)
        except Exception:  # noqa: BLE001 - counted in _done
            pass
        with self._lock:
            self._writes.pop(key, None)
        return bool(w.ok)

    def gauges(self) -> dict[str, int]:
        with self._lock:
            lags = sorted(self._lags)
            queued = [w for w in self._writes.values() if w.ok is None]
        out = {"durable_queued": len(queued), "durable_queued_bytes": sum(w.nbytes for w in queued)}
        for name, q in (("p50", 0.50), ("p99", 0.99)):
            out[f"durable_lag_{name}_ms"] = round(1000 * lags[min(len(lags) - 1, int(q * len(lags)))]) if lags else 0
        return out

    # ---- on the mover's thread: never the store's lock
    def _done(self, write: _Write) -> None:
        exc = write.future.exception()
        now = time.monotonic()
        with self._lock:
            write.ok = exc is None
            if exc is None:
                took = now - max(write.at, self._last_done)
                self._last_done = now
                if write.nbytes:
                    self._s_per_byte = RATE_WEIGHT * took / write.nbytes + (1 - RATE_WEIGHT) * self._s_per_byte
                self._lags.append(now - write.at)
                self.counters["durable_writes"] += 1
                self.counters["durable_bytes"] += write.nbytes
        if exc is not None:
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        with self._lock:
            if isinstance(exc, CapacityError):            # no room in the disk budget: not an error
                self.counters["durable_dropped"] += 1
                return
            self.counters["durable_write_errors"] += 1
        kind = type(exc).__name__
        if kind not in self._logged:          # once per kind: a full disk stays full for a while
            self._logged.add(kind)
            log.warning("mmtier store write-behind: a write to the disk tier failed (%s: %s); serving goes "
                        "on, the group is written when the host tier spills it", kind, exc)
