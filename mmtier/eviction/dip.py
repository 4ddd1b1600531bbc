"""Dynamic insertion (DIP, Qureshi et al., ISCA'07): set dueling between LRU and bimodal
insertion, over prefix chains, weighed by recompute cost."""

from __future__ import annotations

from ..config import CacheConfig
from ..core.groups import ModalityGroup
from .base import Clock
from .bimodal import BimodalLRUPolicy

LRU_LEADER, BIP_LEADER = 0, 1
FOLLOWER = 2


class DIPPolicy(BimodalLRUPolicy):
    """Learns, online, whether new chains should be inserted as LRU does or bimodally.

    Rule: every chain belongs to a set: a new group below a new (never reused) parent takes its
    parent's, any other takes ``key.digest[1] % sets``. Set 0 always inserts as LRU, set 1 always
    bimodally (``BimodalLRUPolicy``: three chains in four filed at the LRU end until reused);
    each store (a miss) in set 0 adds its recompute cost (``num_tokens * recompute_cost``: a
    large image weighs more than a 16-token chunk) to the selector ``psel``, each in set 1
    subtracts it, within ``+-psel_limit``. Every other set follows the leader that misses
    less: bimodal while ``psel > 0``, else LRU; the choice is made once per new group, at its
    store. Ordering after that is ``BimodalLRUPolicy``'s (LRU among admitted and reused
    groups), leaf-first, pins and leases the mechanism's."""

    name = "dip"
    sets = 32
    psel_limit = 1e7

    def __init__(self, cfg: CacheConfig, clock: Clock | None = None):
        super().__init__(cfg, clock)
        self.psel = 0.0
        self._set: dict[int, int] = {}

    def _set_of(self, group: ModalityGroup) -> int:
        parent = group.parent
        if parent is not None and parent.hits == 0 and parent.gid in self._set:
            return self._set[parent.gid]
        if group.key is None:
            return FOLLOWER
        return group.key.digest[1] % self.sets

    def on_insert(self, group: ModalityGroup) -> None:
        s = self._set_of(group)
        self._set[group.gid] = s
        cost = group.recompute_cost
        if s == LRU_LEADER:
            self.psel = min(self.psel + cost, self.psel_limit)
        elif s == BIP_LEADER:
            self.psel = max(self.psel - cost, -self.psel_limit)
        lru = s == LRU_LEADER or (s >= FOLLOWER and self.psel <= 0)
        super().on_insert(group)         # files it by bimodal admission (``_admitted``) ...
        if lru and not self._admitted.get(group.gid, True):
            self._admitted[group.gid] = True      # ... or, inserting as LRU, at the MRU end
            entry = self._entries[group.gid]
            self._file(entry, self._key(entry))

    def on_remove(self, group: ModalityGroup) -> None:
        super().on_remove(group)
        self._set.pop(group.gid, None)
