"""Bimodal insertion by chain class (new branch, continuation, come-back), with a ghost of the
groups that left: LRU for what a chain reuses, a stable sample of new branches kept for long."""

from __future__ import annotations

from ..config import CacheConfig
from ..core.groups import ModalityGroup
from .base import Clock, EvictionPolicy, PolicyEntry
from .lanes import Ghosts


class ChainBIPPolicy(EvictionPolicy):
    """LRU among what prefix chains reuse; new branches off shared content mostly at the LRU end.

    Rule: a new group is *admitted* (ordered by recency, as LRU does) when

    1. its digest is in the ghost: it left the cache not long ago and is wanted again;
    2. its recompute cost per byte is at least ``dense`` times the cheapest modality's
       (``lanes.density``): an image or an audio clip is worth its bytes, a page of text less;
    3. it has no cached parent (a root, or content-only media);
    4. its parent is new in this chain too (``parent.hits == 0``): it takes the parent's class,
       so a request's new blocks stay together;
    5. its parent was reused exactly once (``parent.hits == 1``): a chat's next turn extends
       the chain its previous turn left; continuations are reused soon, often within a turn;
    6. its parent is shared content (reused more than once: a system prompt, a popular
       document), so the group starts a new branch there: admitted only when its digest falls
       in ``1 / admit_every`` of the hash space (deterministic, pseudo-random).

    A group that is not admitted is filed at the LRU end (before every admitted or reused group,
    LRU among its kind) until a later lookup finds it (``group.hits`` grows): then it is
    recency-ordered like the rest. New branches are most of what production prefix traces
    store and are reused, if at all, later than an LRU of a few percent remembers; a stable
    sample of them stays until its reuse, instead of every branch passing through and none
    staying. A group that is dropped leaves its digest in the ghost, at most ``ghost_tiers``
    times the most bytes the policy has tracked at once; coming back while remembered admits it
    (rule 1) and, through rule 4, the new groups chained below it. Each call is the
    mechanism's heaps (O(log n)) plus O(1) dictionary and ghost work; leaf-first, pins and
    leases are the mechanism's."""

    name = "chain_bip"
    admit_every = 8
    dense = 2.0
    ghost_tiers = 3.0
    _UNADMITTED = float(1 << 52)

    def __init__(self, cfg: CacheConfig, clock: Clock | None = None):
        super().__init__(cfg, clock)
        self._admitted: dict[int, bool] = {}
        self._ghost = Ghosts()
        self._bytes: dict[int, int] = {}      # gid -> bytes counted in ``tracked``
        self.tracked = 0                      # bytes of the groups tracked now ...
        self.peak = 0                         # ... and at most (the tiers' size once full)
        # ``lanes.density``'s reference (the cheapest modality's cost per byte), fixed per config
        self._cheapest = max(min(s.recompute_cost / s.token_bytes for s in cfg.modalities.values()), 1e-12)

    def _admits(self, group: ModalityGroup, nbytes: int) -> bool:
        """Rules 1-6 for a new group of ``nbytes`` (rule 1 forgets the ghost's digest)."""
        if group.key is not None and self._ghost.take(group.key.digest):
            return True
        if group.recompute_cost / max(nbytes, 1) >= self.dense * self._cheapest:
            return True
        parent = group.parent
        if parent is None or parent.gid not in self._admitted:
            return True
        if parent.hits == 0:
            return self._admitted[parent.gid]
        if parent.hits == 1 or group.key is None:
            return True
        return group.key.digest[0] % self.admit_every == 0

    def on_insert(self, group: ModalityGroup) -> None:
        nbytes = group.nbytes
        self._admitted[group.gid] = self._admits(group, nbytes)
        self.tracked += nbytes - self._bytes.get(group.gid, 0)   # (a repeated insert)
        self._bytes[group.gid] = nbytes
        if self.tracked > self.peak:
            self.peak = self.tracked
        super().on_insert(group)

    def on_remove(self, group: ModalityGroup) -> None:
        nbytes = self._bytes.pop(group.gid, None)
        if nbytes is not None and group.key is not None:
            self._ghost.add(group.key.digest, nbytes, max(int(self.ghost_tiers * self.peak), nbytes))
        self.tracked -= nbytes or 0
        self._admitted.pop(group.gid, None)
        super().on_remove(group)

    def _key(self, entry: PolicyEntry) -> float:
        g = entry.group
        if g.hits > 0 or self._admitted.get(g.gid, True):
            return float(self.tick)
        return float(self.tick) - self._UNADMITTED
