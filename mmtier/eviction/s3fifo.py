"""S3-FIFO over groups and prefix chains (Yang et al., SOSP'23), byte- and cost-aware."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import CacheConfig
from ..core.groups import ModalityGroup, Tier
from .base import Clock, EvictionPolicy, PolicyEntry
from .lanes import Ghosts, density

SMALL, MAIN = 0, 1
_FIRST = float(1 << 40)          # rank offset: the lane that must give up bytes goes first


@dataclass
class _State:
    seen: int = 0                # group.hits when last looked at
    credit: int = 0              # CLOCK credit in the main queue


class S3FIFOPolicy(EvictionPolicy):
    """Scan-resistant: a small probationary FIFO in front of a main FIFO, and a ghost FIFO.

    Rule, per ``(tier, modality)``: a new group enters the small queue (``S``), or the main one
    (``M``) when its digest is in the ghost (it was dropped from ``S`` not long ago). Both are
    FIFO by insertion; an access never moves a group. Reuse is what a later lookup found
    (``group.hits``), not the attach of the request that stored it. Victims come from ``S``
    while ``S`` holds more than ``small_fraction`` of the bytes of the two queues, else from
    ``M``; a group at the head of ``S`` that was reused moves to ``M`` instead of going (the
    one-hit wonders, most groups of prefix traces, never reach ``M``), and a group dropped from
    ``S`` leaves its digest in the ghost (bounded by the bytes ``M`` may hold: ``1 -
    small_fraction`` of the most bytes the policy has tracked at once, ``LaneBytes.peak``). At
    the head of ``M`` a group with credit goes back to the tail with one credit less (CLOCK);
    across pools (host and disk tiers) groups re-filed in one call keep the order in which the
    scans reach them. Each reuse earns
    ``max(1, round(density))`` credits, at most three reuses' worth, where ``density`` is its
    recompute cost per byte over the cheapest modality's (``lanes.density``): a page of image
    KV outlives a page of text as often as it costs more to recompute. Leaf-first, pins and
    leases are the mechanism's (a child always goes before its parent)."""

    name = "s3fifo"
    lanes = 2
    small_fraction = 0.1

    def __init__(self, cfg: CacheConfig, clock: Clock | None = None):
        super().__init__(cfg, clock)
        self._state: dict[int, _State] = {}
        self._ghost = Ghosts()
        self._over: dict[str, bool] = {}

    def _new_lane(self, group: ModalityGroup) -> int:
        self._state[group.gid] = _State(seen=group.hits)
        return MAIN if group.key is not None and self._ghost.take(group.key.digest) else SMALL

    def _key(self, entry: PolicyEntry) -> float:
        return entry.key if entry.seq >= 0 else float(self.tick)    # FIFO: insertion order

    def _plan(self, tier: Tier) -> None:
        self._over = {m: self.lane_bytes.over(tier, m, SMALL, self.small_fraction) for m in self.cfg.modalities}

    def _rank(self, key: float, modality: str, lane: int = 0) -> float:
        if lane == MAIN:
            return key
        return key - _FIRST if self._over.get(modality, True) else key + _FIRST

    def _second_chance(self, entry: PolicyEntry) -> bool:
        st = self._state[entry.group.gid]
        new = entry.group.hits - st.seen
        st.seen = entry.group.hits
        if entry.lane == SMALL:
            if new <= 0:
                return False
            st.credit = 0
        else:
            unit = max(1, round(density(self.cfg, entry.group)))
            st.credit = min(st.credit + new * unit, 3 * unit)
            if st.credit <= 0:
                return False
            st.credit -= 1
        self.tick += 1
        self._refile(entry, float(self.tick), MAIN)
        return True

    def on_remove(self, group: ModalityGroup) -> None:
        entry = self._entries.get(group.gid)
        if entry is not None and entry.lane == SMALL and group.key is not None:
            limit = int((1 - self.small_fraction) * self.lane_bytes.peak)
            self._ghost.add(group.key.digest, group.nbytes, max(limit, group.nbytes))
        super().on_remove(group)
        self._state.pop(group.gid, None)
