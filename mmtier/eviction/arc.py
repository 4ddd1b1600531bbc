"""Adaptive replacement (ARC, Megiddo and Modha, FAST'03) over groups and prefix chains, in bytes
and recompute cost."""

from __future__ import annotations

from ..config import CacheConfig
from ..core.groups import ModalityGroup, Tier
from .base import Clock, EvictionPolicy, PolicyEntry
from .lanes import Ghosts, density, reused

RECENT, FREQUENT = 0, 1
_FIRST = float(1 << 40)          # rank offset: the lane over its target goes first


class ARCPolicy(EvictionPolicy):
    """Adaptive between recency and frequency: two LRU lanes and their ghosts, one learned target.

    Rule, per ``(tier, modality)``: a group sits in ``T1`` (recent: not reused since it was
    stored) or ``T2`` (frequent: a later lookup found it, ``group.hits`` grew, or it came back
    while its digest was in a ghost); each lane is LRU. Victims come from ``T1`` while ``T1``
    holds more than the fraction ``target`` of the two lanes' bytes, else from ``T2``. A group
    that leaves ``T1`` (``T2``) leaves its digest in ghost ``B1`` (``B2``), each bounded by the
    most bytes the policy has tracked at once (``LaneBytes.peak``: the tiers' size once full).
    ``target`` is learned: a group stored again while in ``B1`` (recency was cut too short)
    raises it, one in ``B2`` lowers it, by the group's bytes times its recompute cost per byte
    (``lanes.density``) over that peak, scaled by the ghosts' size ratio as in ARC. Leaf-first,
    pins and leases are the mechanism's."""

    name = "arc"
    lanes = 2

    def __init__(self, cfg: CacheConfig, clock: Clock | None = None):
        super().__init__(cfg, clock)
        self.target = 0.5
        self._seen: dict[int, int] = {}
        self._b1, self._b2 = Ghosts(), Ghosts()
        self._over: dict[str, bool] = {}

    # -- lanes
    def _new_lane(self, group: ModalityGroup) -> int:
        self._seen[group.gid] = group.hits
        if group.key is not None:
            d = group.key.digest
            total = max(self.lane_bytes.peak, group.nbytes)
            step = group.nbytes * density(self.cfg, group) / total
            if d in self._b1:
                ratio = max(1.0, self._b2.nbytes / max(self._b1.nbytes, 1))
                self.target = min(1.0, self.target + ratio * step)
                self._b1.take(d)
                return FREQUENT
            if d in self._b2:
                ratio = max(1.0, self._b1.nbytes / max(self._b2.nbytes, 1))
                self.target = max(0.0, self.target - ratio * step)
                self._b2.take(d)
                return FREQUENT
        return RECENT

    def on_access(self, group: ModalityGroup) -> None:
        entry = self._entries.get(group.gid)
        if entry is not None and reused(self._seen, group):
            entry.lane = FREQUENT
        super().on_access(group)

    def _key(self, entry: PolicyEntry) -> float:
        return float(self.tick)

    # -- victims
    def _plan(self, tier: Tier) -> None:
        self._over = {m: self.lane_bytes.over(tier, m, RECENT, self.target) for m in self.cfg.modalities}

    def _rank(self, key: float, modality: str, lane: int = 0) -> float:
        first = self._over.get(modality, True) == (lane == RECENT)
        return key - _FIRST if first else key + _FIRST

    def on_remove(self, group: ModalityGroup) -> None:
        entry = self._entries.get(group.gid)
        if entry is not None and group.key is not None:
            limit = max(self.lane_bytes.peak, group.nbytes)
            (self._b1 if entry.lane == RECENT else self._b2).add(group.key.digest, group.nbytes, limit)
        super().on_remove(group)
        self._seen.pop(group.gid, None)
