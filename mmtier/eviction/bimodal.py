"""Bimodal insertion LRU (BIP) over prefix chains."""

from __future__ import annotations

from ..config import CacheConfig
from ..core.groups import ModalityGroup
from .base import Clock, EvictionPolicy, PolicyEntry


class BimodalLRUPolicy(EvictionPolicy):
    """Thrash-resistant LRU: bimodal insertion (BIP, Qureshi et al., ISCA 2007) over prefix
    chains. Rule: a group that has been reused (``group.hits > 0``: a later lookup found it)
    or was admitted is ordered by recency like LRU; a new, unadmitted group is filed at the LRU
    end (it goes before every admitted or reused group, LRU among its kind). Admission is decided
    once per new chain: the first new group below cached content is admitted when its key's
    digest falls in ``1 / admit_every`` of the hash space (deterministic, pseudo-random), and
    new groups chained to a new parent inherit its decision, so a request's new blocks stay
    together. When reuse distances exceed the cache (most blocks of production prefix traces
    are first references, reused, if at all, long after), LRU keeps only the newest content and
    loses it before its reuse; bimodal insertion keeps a stable fraction of chains resident
    until they are reused, and anything reused becomes LRU-ordered."""

    name = "bimodal_lru"
    admit_every = 4
    _UNADMITTED = float(1 << 52)

    def __init__(self, cfg: CacheConfig, clock: Clock | None = None):
        super().__init__(cfg, clock)
        self._admitted: dict[int, bool] = {}

    def on_insert(self, group: ModalityGroup) -> None:
        parent = group.parent
        if parent is not None and parent.hits == 0 and parent.gid in self._admitted:
            admit = self._admitted[parent.gid]
        elif group.key is None:
            admit = True
        else:
            admit = group.key.digest[0] % self.admit_every == 0
        self._admitted[group.gid] = admit
        super().on_insert(group)

    def on_remove(self, group: ModalityGroup) -> None:
        super().on_remove(group)
        self._admitted.pop(group.gid, None)

    def _key(self, entry: PolicyEntry) -> float:
        g = entry.group
        if g.hits > 0 or self._admitted.get(g.gid, True):
            return float(self.tick)
        return float(self.tick) - self._UNADMITTED
