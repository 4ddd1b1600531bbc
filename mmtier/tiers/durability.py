"""``WriteBehind``: every shared group saved into a cache with a disk tier is also written to
disk in the background, once, so a process stopped by a signal or killed outright (vLLM kills
its workers without calling the connectors' ``shutdown``; the OOM killer; a node lost) loses
at most the saves of the last ``durable_lag_s``, not everything its device and host tiers held.

Its own state: the queue of saves not written yet, the byte rate the disk was measured to take,
the lags of the latest writes and its one thread. The groups, their tiers and the disk budget
stay ``Residency``'s and ``LowerTiers``': this part asks the lower tiers to start a copy
(``LowerTiers.start_durable_copy``, the same verified writer as a spill: Arrow IPC, xxh3 per
page, tmp + fsync + rename + directory fsync) and the cache's lock guards every look at a group.

- ``saved`` (the group index calls it, lock held, for each new shared group: a put, an import,
  a sealed run) queues the group when the queued bytes drain within half of ``durable_lag_s``
  at the measured rate (``HEADROOM``; an empty queue always takes it); else the save is dropped from the
  write-behind, counted (``durable_dropped``), and the group is written only when it is evicted
  or at close, as without write-behind. Nothing waits on the disk: a save never blocks.
- The thread yields to saves: it starts a batch only once no save has come for
  ``durable_quiet_s`` (the holdback: its copy, checksums and writes beside a burst of saves
  slowed the saves on a small machine, benchmarks/RESULTS_NOTES.md), and at the latest when
  the oldest queued save has waited half of ``durable_lag_s`` or what is left of its bound is
  twice the queue's estimated drain (``hold_until``: the admission's margin for a disk at half
  its measured rate), so a continuous stream of saves is still written within its bound.
  ``drain`` (a flush) and ``close`` skip the holdback.
- The thread takes what is queued (up to ``max_inflight_bytes`` a batch), pins its device
  groups under the lock, copies their pages into host memory with the lock let go (a copy
  under the lock held every save, read and attention of the cache behind it: 50-120 ms per
  128 MiB of saves on the 2-core machine, benchmarks/RESULTS_NOTES.md), then under the lock
  unpins them and starts each group's copy to disk: a device group's from its snapshot, a
  host group's from its slots (held until written; they never change), so nothing stays pinned
  while the disk writes and eviction keeps its order; it waits for the copies with the lock
  let go. A group freed,
  re-keyed or already on disk by then (an eviction wrote it) is skipped; one evicted meanwhile
  from the device to the host is written from the host; one freed while its copy was written
  has the file removed again.
- A write that fails (disk full, the free-space floor, an I/O error) is counted
  (``durable_write_errors``), logged once per kind of error, and serving goes on.
- A group with a durable copy costs no second write: its eviction to disk only drops the memory
  copy (``LowerTiers``), and a promotion keeps the file.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass

import torch

from ..config import CacheConfig
from ..core.groups import ModalityGroup, Tier
from ..errors import MMTierError
from ..stats import Counters
from .lower import WAIT_S
from .residency import GroupDirectory, Residency

log = logging.getLogger(__name__)
FIRST_RATE = 32 << 20        # bytes / s assumed until the first write was measured
# a save is queued while the backlog drains within this share of the lag bound: the disk's
# rate varies (on a shared 2-core VM by 2x within seconds), and the estimate lags behind it
HEADROOM = 0.5
MAX_QUEUED = 65536           # saves queued at most (the queue holds references, not pages)
LAG_WINDOW = 4096            # the latest writes whose lags the percentiles cover
RATE_WEIGHT = 0.3            # weight of the newest batch in the measured rate


def hold_until(oldest_at: float, last_at: float, backlog_s: float, quiet_s: float, lag_s: float) -> float:
    """When the next batch starts (monotonic seconds): once saves have been quiet for
    ``quiet_s`` after the last one, and no later than the oldest queued save's bound less the
    queue's estimated drain (``backlog_s``) taken twice (the admission's margin for a disk at
    half its measured rate), nor than the share of the lag admission leaves free."""
    return min(last_at + quiet_s, oldest_at + min((1 - HEADROOM) * lag_s, lag_s - backlog_s / HEADROOM))


@dataclass(frozen=True)
class _Save:
    group: ModalityGroup
    nbytes: int
    at: float                # monotonic time of the save


class WriteBehind:
    """The background writer of one cache's saves to its disk tier (see the module doc)."""

    def __init__(self, cfg: CacheConfig, residency: Residency, index: GroupDirectory, counters: Counters):
        self.lag_s, self.quiet_s = cfg.durable_lag_s, cfg.durable_quiet_s
        self.batch_bytes = cfg.max_inflight_bytes
        self.residency, self.index, self.counters = residency, index, counters
        self._cond = threading.Condition()
        self._queue: collections.deque[_Save] = collections.deque()
        self._queued_bytes = 0
        self._writing_bytes = 0
        self._s_per_byte = 1.0 / FIRST_RATE
        self._lags: collections.deque[float] = collections.deque(maxlen=LAG_WINDOW)
        self._logged: set[str] = set()
        self._closed = False
        self._last_save = 0.0
        self._wake_at = float("inf")  # when the thread, holding back, looks again
        self._draining = 0            # drain() callers waiting: no holdback meanwhile
        self._thread = threading.Thread(target=self._run, name="mmtier-write-behind", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ saves (cache lock held)
    def saved(self, group: ModalityGroup) -> None:
        """A new shared group: queue its write, or drop it when the disk is behind (counted)."""
        if group.key is None or group.tier == Tier.DISK:
            return
        nbytes = group.nbytes
        with self._cond:
            if self._closed:
                return
            backlog = self._queued_bytes + self._writing_bytes + nbytes
            behind = (self._queue or self._writing_bytes) and backlog * self._s_per_byte > HEADROOM * self.lag_s
            if behind or len(self._queue) >= MAX_QUEUED:
                self.counters.add("durable_dropped", group.modality)
                return
            now = time.monotonic()
            self._queue.append(_Save(group, nbytes, now))
            self._queued_bytes += nbytes
            self._last_save = now
            if self._start_at() < self._wake_at:     # its deadline came closer, or the thread is idle
                self._cond.notify_all()

    # ------------------------------------------------------------------ waiting, stats, close
    def drain(self, timeout: float = WAIT_S) -> bool:
        """Wait until every queued save is written (or skipped); ``True`` if so in ``timeout``."""
        with self._cond:
            self._draining += 1
            self._cond.notify_all()
            try:
                return self._cond.wait_for(lambda: not self._queue and not self._writing_bytes, timeout)
            finally:
                self._draining -= 1

    def gauges(self) -> dict[str, int]:
        """The queue now and the lag of the latest writes (ms), for ``CacheStats.counters``."""
        with self._cond:
            lags = sorted(self._lags)
            out = {"durable_queued": len(self._queue), "durable_queued_bytes": self._queued_bytes,
                   "durable_rate_bytes_per_s": int(1.0 / self._s_per_byte)}
        for name, q in (("p50", 0.50), ("p99", 0.99)):
            out[f"durable_lag_{name}_ms"] = round(1000 * lags[min(len(lags) - 1, int(q * len(lags)))]) if lags else 0
        out["durable_lag_max_ms"] = round(1000 * lags[-1]) if lags else 0
        return out

    def close(self, timeout: float = WAIT_S) -> None:
        """Take no more saves; the thread writes what is queued, then ends (bounded in time)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the thread
    def _start_at(self) -> float:
        """When the thread may start its next batch (``_cond`` held, the queue not empty)."""
        if self._closed or self._draining:
            return 0.0
        backlog_s = (self._queued_bytes + self._writing_bytes) * self._s_per_byte
        return hold_until(self._queue[0].at, self._last_save, backlog_s, self.quiet_s, self.lag_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:                   # wait for saves, then for them to go quiet
                    if not self._queue:
                        if self._closed:
                            return
                        self._wake_at = float("inf")
                        self._cond.wait()
                        continue
                    self._wake_at = self._start_at()
                    wait = self._wake_at - time.monotonic()
                    if wait <= 0:
                        break
                    self._cond.wait(wait)
                self._wake_at = float("inf")
                batch: list[_Save] = []
                while self._queue and (not batch or self._writing_bytes + self._queue[0].nbytes <= self.batch_bytes):
                    save = self._queue.popleft()
                    self._queued_bytes -= save.nbytes
                    self._writing_bytes += save.nbytes
                    batch.append(save)
            try:
                self._write(batch)
            except Exception as exc:  # noqa: BLE001 - the thread must outlive any one batch
                self._error(exc)
            finally:
                with self._cond:
                    self._writing_bytes = 0
                    self._cond.notify_all()

    def _gone(self, g: ModalityGroup) -> bool:
        """The group needs no write-behind any more (counted): it left the cache, or an eviction
        wrote it (lock held)."""
        if (g.freed or g.key is None or self.index.groups.get(g.key) is not g or g.tier == Tier.DISK
                or self.residency.lower.disk_copy(g) is not None):
            self.counters.add("durable_skipped", g.modality)
            return True
        return False

    def _unpin(self, pinned: list[ModalityGroup]) -> None:
        with self.residency.lock:            # re-entrant: also called with the lock held
            for g in pinned:
                g.pins -= 1
                self.residency.settle(g)     # one freed meanwhile lets its pages go now

    def _write(self, batch: list[_Save]) -> None:
        residency, lower = self.residency, self.residency.lower
        started = []
        t0 = time.monotonic()
        with residency.lock:
            residency.apply_copies()
            batch = [s for s in batch if not self._gone(s.group)]
            pinned = [s.group for s in batch if s.group.tier == Tier.DEVICE]
            for g in pinned:
                g.pins += 1                  # its pages stay put while copied without the lock
        snaps: dict[int, torch.Tensor] = {}
        try:                                 # saves, reads and attention go on meanwhile
            for g in pinned:
                snaps[g.gid] = lower.snapshot(g)
        except BaseException:
            self._unpin(pinned)
            raise
        with residency.lock:
            self._unpin(pinned)
            residency.apply_copies()
            for save in batch:
                g = save.group
                if self._gone(g):
                    continue
                try:                         # from its snapshot, or its host slots (held)
                    fut = lower.start_durable_copy(g, snaps.get(g.gid) if g.tier == Tier.DEVICE else None)
                except (MMTierError, OSError) as exc:
                    self._error(exc, g)
                    continue
                if fut is None:
                    self.counters.add("durable_dropped", g.modality)      # no room in the disk budget
                    continue
                started.append((save, g, fut))
        done: list[_Save] = []
        for save, g, fut in started:
            try:
                fut.result(timeout=WAIT_S)
            except Exception as exc:  # noqa: BLE001 - a failed write is counted, serving goes on
                self._error(exc, g)
                continue
            done.append(save)
            now = time.monotonic()
            with self._cond:
                self._lags.append(now - save.at)
            self.counters.add("durable_writes", g.modality)
            self.counters.add("durable_bytes", g.modality, save.nbytes)
        with residency.lock:
            for _, g, _ in started:
                lower.end_durable_copy(g, orphan=g.freed and g.key not in self.index)
        written = sum(s.nbytes for s in done)
        if written:
            rate = (time.monotonic() - t0) / written
            with self._cond:
                self._s_per_byte = RATE_WEIGHT * rate + (1 - RATE_WEIGHT) * self._s_per_byte

    def _error(self, exc: BaseException, group: ModalityGroup | None = None) -> None:
        self.counters.add("durable_write_errors", group.modality if group is not None else None)
        kind = type(exc).__name__
        if kind not in self._logged:          # once per kind: a full disk stays full for a while
            self._logged.add(kind)
            log.warning("mmtier write-behind: a write to the disk tier failed (%s: %s); serving goes on, "
                        "the group is written when it is evicted or at close if the disk takes it then",
                        kind, exc)
