"""``Room``: device pages for new and promoted groups, made by moving whole groups down.

Policy picks the groups (the eviction policy's victims first, then referenced groups nobody
reads right now, least recently used first); mechanism moves them (``LowerTiers``: staged copies,
then one commit). Making room is all or nothing: ``CapacityError`` before anything moves when
not enough can go, and a lower tier that refuses one of the chosen groups undoes the copies
already made. A spill it waits for is awaited with the cache's lock let go (the groups marked
``busy``); when what could move is only held for a moment (groups read or moved by other
threads), a call with a deadline waits until another thread lets go of the lock and looks again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from ..core.groups import ModalityGroup, Tier
from ..core.locking import OwnerLock
from ..errors import CapacityError
from ..eviction import EvictionPolicy
from ..pages.pool import PagePool
from .lower import LowerTiers, StagedCopy

ROOM_WAIT_S = 30.0   # the longest a call waits for pages other threads read or move right now


class Room:
    """Makes room in the device pools of one cache (called with its lock held)."""

    def __init__(self, lock: OwnerLock, policy: EvictionPolicy, lower: LowerTiers,
                 live_groups: Callable[[], list[ModalityGroup]], drop: Callable[[ModalityGroup], None],
                 pools: Mapping[str, PagePool]):
        self.lock, self.policy, self.lower = lock, policy, lower
        self.pools = pools                      # modality -> its device pool (a victim's own pool:
                                                # leaf-first may choose a child in another one)
        self.live_groups = live_groups          # every group indexed or held by a sequence
        self.drop = drop                        # evict a group (it leaves the cache)

    def allocate(self, pool: PagePool, n: int, protect: list[ModalityGroup]) -> list[int]:
        """``n`` pages of ``pool``, demoting whole groups first if needed (``make_room`` may let
        go of the lock while it waits: what the caller looked up may have changed)."""
        deadline = time.monotonic() + ROOM_WAIT_S
        while n > pool.num_free:
            self.make_room(pool, n - pool.num_free, protect, deadline=deadline)
        return pool.allocate(n)

    def make_room(self, pool: PagePool, pages_needed: int, protect: list[ModalityGroup],
                   referenced: bool = True, deadline: float | None = None) -> None:
        """Free ``pages_needed`` pages of ``pool`` by moving whole groups down (or dropping them
        at the bottom). Unreferenced groups go first, in the policy's order; with lower tiers,
        referenced groups not in use may be demoted too (attention serves them where they are).

        All or nothing: ``CapacityError`` before anything moves when not enough can go, and
        when a lower tier refuses one of the chosen groups, the copies already made are undone.
        The copies are made first (the groups marked ``busy``; a spill is awaited with the lock
        let go), then committed together; a group pinned or freed meanwhile keeps its pages
        (the caller sees fewer free pages and tries again).

        With a ``deadline``, when what could move is only held for a moment (groups other
        threads read or move now), it waits until another thread lets go of the lock and
        returns (the caller looks again); past the deadline it raises ``CapacityError``."""
        seen = self.lock.generation
        try:
            chosen = self._victims(pool, pages_needed, protect, referenced)
        except CapacityError:
            if deadline is None or not self._held_for_now(pool, protect):
                raise
            left = deadline - time.monotonic()
            if left <= 0 or not self.lock.wait_change(seen, left):
                raise
            return
        for g in chosen:
            g.busy += 1
        staged: list[tuple[ModalityGroup, StagedCopy | None]] = []
        refused = None
        try:
            for g in chosen:
                copy = self.lower.stage_demotion(g, self.pools[g.modality]) \
                    if self.lower.enabled and not g.freed else None
                if copy is None and g.refs > 0 and not g.freed:
                    refused = g
                    break
                staged.append((g, copy))
        except BaseException:
            for _, copy in staged:
                if copy is not None:
                    self.lower.undo_demotion(copy)
            raise
        finally:
            for g in chosen:
                g.busy -= 1
        if refused is not None:
            for _, copy in staged:
                if copy is not None:
                    self.lower.undo_demotion(copy)
            raise CapacityError(f"{refused!r} is in use and no lower tier could take it")
        for g, copy in staged:
            if g.freed or g.pins > 0 or g.tier != Tier.DEVICE or (copy is None and g.refs > 0):
                if copy is not None:                      # changed while a spill was awaited
                    self.lower.undo_demotion(copy)
            elif copy is None:
                self.drop(g)
            else:
                self.lower.commit_demotion(g, copy, self.pools[g.modality])

    def _victims(self, pool: PagePool, pages_needed: int, protect: list[ModalityGroup],
                 referenced: bool) -> list[ModalityGroup]:
        """The device groups to move for ``pages_needed`` pages, or ``CapacityError``."""
        spec = pool.spec
        chosen, got = [], 0
        for g in self.policy.victims(Tier.DEVICE, pages_needed * spec.page_bytes, spec.name):
            if got >= pages_needed:
                break
            if g not in protect:
                chosen.append(g)
                got += len(g.pages) if g.modality == spec.name else 0   # a child in another pool
        if got < pages_needed and referenced and self.lower.enabled:
            held = sorted((g for g in self.live_groups()
                           if g.tier == Tier.DEVICE and g.modality == spec.name
                           and g.refs > 0 and g.pins == 0 and g.busy == 0
                           and g not in protect), key=lambda g: g.last_access)
            for g in dict.fromkeys(held):
                if got >= pages_needed:
                    break
                if g not in chosen:
                    chosen.append(g)
                    got += len(g.pages)
        if got < pages_needed:
            raise CapacityError(
                f"{spec.name} pool: {pages_needed} more pages needed, {pool.num_free} free of {pool.num_pages} "
                f"and only {got} pages held by groups that can move (no lower tier could take more)")
        return chosen

    def _held_for_now(self, pool: PagePool, protect: list[ModalityGroup]) -> bool:
        """Whether device groups of ``pool`` are held only for a moment: read by an attention
        call (pinned) or being moved by another thread (busy)."""
        return any(g.tier == Tier.DEVICE and g.modality == pool.spec.name and (g.pins or g.busy)
                   and g not in protect for g in self.live_groups())

