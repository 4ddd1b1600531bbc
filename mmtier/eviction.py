"""Eviction policies over modality groups (policy only: no pages, no copies).

A policy sees ``on_insert / on_access / on_release / on_remove`` and answers
``victims(tier, bytes_needed, modality=None)``: evictable groups in that tier (optionally of one
modality's pool), in eviction order, until their bytes cover ``bytes_needed`` (fewer when not
enough can go; the caller decides what that means). A new policy is one class plus one line in
``POLICIES``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from .config import CacheConfig
from .groups import ModalityGroup, Tier


class EvictionPolicy:
    """Base: tracks groups in recency order; subclasses change ``_order``."""

    name = "base"

    def __init__(self, cfg: CacheConfig):
        self.cfg = cfg
        self._groups: OrderedDict[int, ModalityGroup] = OrderedDict()   # oldest first

    def on_insert(self, group: ModalityGroup) -> None:
        self._groups[group.gid] = group
        self._groups.move_to_end(group.gid)

    def on_access(self, group: ModalityGroup) -> None:
        if group.gid in self._groups:
            self._groups.move_to_end(group.gid)

    def on_release(self, group: ModalityGroup) -> None:
        """The last reference went away: the group became a candidate."""

    def on_remove(self, group: ModalityGroup) -> None:
        self._groups.pop(group.gid, None)

    def victims(self, tier: Tier, bytes_needed: int, modality: str | None = None) -> list[ModalityGroup]:
        out: list[ModalityGroup] = []
        got = 0
        if bytes_needed <= 0:
            return out
        for group in self._order(tier, modality):
            out.append(group)
            got += group.nbytes
            if got >= bytes_needed:
                break
        return out

    def _candidates(self, tier: Tier, modality: str | None) -> Iterator[ModalityGroup]:
        for group in self._groups.values():
            if group.tier == tier and (modality is None or group.modality == modality) and group.evictable:
                yield group

    def _order(self, tier: Tier, modality: str | None) -> Iterator[ModalityGroup]:
        return self._candidates(tier, modality)


class LRUPolicy(EvictionPolicy):
    """Least recently used group first."""

    name = "lru"


POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
}


def make_policy(cfg: CacheConfig) -> EvictionPolicy:
    try:
        return POLICIES[cfg.eviction_policy](cfg)
    except KeyError:
        from .errors import ConfigError

        raise ConfigError(f"eviction_policy {cfg.eviction_policy!r} is not implemented",
                          ("eviction_policy",)) from None
