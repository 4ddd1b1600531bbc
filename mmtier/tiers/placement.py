"""``PutPlacement``: where a put lands when its device pool has no free pages for it (policy;
the mechanism is ``LowerTiers.reserve_host`` and the cache's store).

A put into a full pool can push other groups one tier down to make room and then write its own
pages (two copies: the victims' and its own), or write around the device straight into the host
tier (one copy) and leave the pool as it is; a group written around comes up to the device when
it is used (promotion, as for any group below). ``CacheConfig.put_placement``:

- ``auto`` (the default): write around where a demotion buys nothing or costs the running
  sequences: the pool is in host memory (a CPU pool: the host tier is the same memory, attended
  in place the same way), or the pool's unreferenced groups are too few to make the room, so
  the demotion would take groups that running sequences hold; otherwise demote;
- ``demote``: always make room (the pool holds the newest puts);
- ``write_around``: never push a group down for a put.

A put writes around only where a host tier exists; if the host tier cannot take the group (its
budget, a spill it waited for failed) the put falls back to the device path.
"""

from __future__ import annotations

from collections.abc import Callable

from ..core.groups import ModalityGroup, Tier
from ..pages.pool import PagePool

PLACEMENTS = ("auto", "demote", "write_around")


class PutPlacement:
    """Decides, per put, whether it writes around the device (called with the cache's lock held)."""

    def __init__(self, mode: str, has_host: bool, live_groups: Callable[[], list[ModalityGroup]]):
        if mode not in PLACEMENTS:
            raise ValueError(f"put placement {mode!r}: one of {PLACEMENTS}")
        self.mode, self.has_host, self.live_groups = mode, has_host, live_groups

    def around(self, pool: PagePool, pages: int) -> bool:
        """Whether a put of ``pages`` pages into ``pool`` goes straight to the host tier."""
        if not self.has_host or pages <= pool.num_free or self.mode == "demote":
            return False
        if self.mode == "write_around" or pool.device.type == "cpu":
            return True
        return self._unreferenced_pages(pool) + pool.num_free < pages

    def _unreferenced_pages(self, pool: PagePool) -> int:
        """Device pages of ``pool`` held by groups no sequence holds (what a demotion may take
        without touching a running sequence's groups)."""
        name, seen, got = pool.spec.name, set(), 0
        for g in self.live_groups():
            if g.gid in seen or g.tier != Tier.DEVICE or g.modality != name:
                continue
            seen.add(g.gid)
            if g.refs == 0:
                got += len(g.pages)
        return got
