"""Leases: time-limited protection of a group during a read or a transfer (mechanism only).

A ``Lease`` protects one group from eviction until its expiry: ``LeaseTable.grant`` records it
in the group's ``leases`` map (lease id -> expiry), which eviction policies read with the same
clock. The rule that keeps reads safe is *validate after reading*: a reader takes a lease,
copies, then calls ``check``; ``check`` fails (``LeaseExpiredError``) once the lease has expired,
was released, or its group was revoked (freed), even if the lease would be renewed later, so a
copy that raced with an eviction and a reuse of the pages is never returned. ``read`` wraps
that pattern. An expired lease is dead for good: ``renew`` refuses it.

Thread-safe (one lock); the clock is injectable so tests need no sleeps.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..core.groups import ModalityGroup
from ..errors import LeaseExpiredError

Clock = Callable[[], float]
T = TypeVar("T")


@dataclass(frozen=True)
class Lease:
    """A grant: ``id``, the group's ``gid`` and the expiry on the table's clock."""

    id: int
    gid: int
    expiry: float


class LeaseTable:
    """Grants, renews, releases and checks leases over ``ModalityGroup``s."""

    def __init__(self, ttl: float = 5.0, clock: Clock | None = None):
        if ttl <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl}")
        self.ttl = ttl
        self.clock: Clock = clock or time.monotonic
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._live: dict[int, tuple[ModalityGroup, Lease]] = {}
        self.expired_reads = 0                # reads refused because their lease had expired

    def grant(self, group: ModalityGroup, ttl: float | None = None) -> Lease:
        with self._lock:
            lease = Lease(next(self._ids), group.gid, self.clock() + (ttl or self.ttl))
            if lease.id % 256 == 0:
                self._sweep()
            self._live[lease.id] = (group, lease)
            group.leases[lease.id] = lease.expiry
            return lease

    def renew(self, lease: Lease, ttl: float | None = None) -> Lease:
        """A later expiry for a live lease; ``LeaseExpiredError`` if it is no longer live."""
        with self._lock:
            group = self._alive(lease)
            new = Lease(lease.id, lease.gid, self.clock() + (ttl or self.ttl))
            self._live[lease.id] = (group, new)
            group.leases[lease.id] = new.expiry
            return new

    def release(self, lease: Lease) -> None:
        """Idempotent: the group is no longer protected by this lease."""
        with self._lock:
            held = self._live.pop(lease.id, None)
            if held is not None:
                held[0].leases.pop(lease.id, None)

    def check(self, lease: Lease) -> None:
        """Raise ``LeaseExpiredError`` unless the lease has been live continuously until now."""
        with self._lock:
            self._alive(lease)

    def alive(self, lease: Lease) -> bool:
        try:
            self.check(lease)
        except LeaseExpiredError:
            return False
        return True

    def revoke(self, gid: int) -> int:
        """The group is being freed: every lease on it dies now. Returns how many."""
        with self._lock:
            dead = [lid for lid, (g, _) in self._live.items() if g.gid == gid]
            for lid in dead:
                group, _ = self._live.pop(lid)
                group.leases.pop(lid, None)
            return len(dead)

    def read(self, group: ModalityGroup, fn: Callable[[], T], ttl: float | None = None) -> T:
        """Run ``fn`` (a copy out of the group's pages) under a lease; return its result only if
        the lease was still live when it finished, else raise ``LeaseExpiredError``."""
        lease = self.grant(group, ttl)
        try:
            result = fn()
            try:
                self.check(lease)
            except LeaseExpiredError:
                with self._lock:
                    self.expired_reads += 1
                raise
            return result
        finally:
            self.release(lease)

    def __len__(self) -> int:
        """Live leases (expired ones are forgotten here)."""
        with self._lock:
            self._sweep()
            return len(self._live)

    def _sweep(self) -> None:
        now = self.clock()
        for lid in [lid for lid, (_, lease) in self._live.items() if lease.expiry <= now]:
            group, _ = self._live.pop(lid)
            group.leases.pop(lid, None)

    def _alive(self, lease: Lease) -> ModalityGroup:
        held = self._live.get(lease.id)
        if held is None:
            raise LeaseExpiredError(f"lease {lease.id} on group {lease.gid} was released or revoked")
        group, current = held
        if current.expiry <= self.clock():
            del self._live[lease.id]          # dead for good: renew cannot revive it
            group.leases.pop(lease.id, None)
            raise LeaseExpiredError(
                f"lease {lease.id} on group {lease.gid} expired at {current.expiry:.3f}")
        return group
