"""Segmented LRU whose probation share is learned from ghosts (ARC's adaptation between LRU and an
S3-FIFO-style probation queue), per pool, in bytes, over prefix chains."""

from __future__ import annotations

from ..config import CacheConfig
from ..core.groups import ModalityGroup, Tier
from .base import Clock, EvictionPolicy
from .lanes import Ghosts, density, reused

PROBATION, PROTECTED = 0, 1
_FIRST = float(1 << 40)          # rank offset: probation over its share goes first


class AdaptiveSLRUPolicy(EvictionPolicy):
    """LRU, except that groups never reused may hold only a learned share of each pool.

    Rule, per ``(tier, modality)``: a new group enters *probation*; a later lookup that finds it
    (``group.hits`` grows) moves it to *protected*, as does coming back while its digest is in a
    ghost, and so does a new group whose recompute cost per byte is at least ``dense`` times the
    cheapest modality's (``lanes.density``: an image or an audio clip is worth its bytes from the
    start), except the KV of generated tokens (``group.generated``: an answer, which most traffic
never repeats), which always starts in probation and teaches the share nothing when it comes
back. Both lanes are ordered by recency. While probation holds more than the share
    ``share[modality]`` of the pool's bytes, its least recent groups go first (the one-hit blocks
    of production prefix traces pass through without pushing out what was reused, as S3-FIFO's
    small queue does); otherwise the two lanes are merged by recency: plain LRU. At share 1 the
    policy is LRU exactly.

    The share is learned as ARC learns its split, from three ghosts per modality, each bounded by
    the most bytes the pool has held (its size once full): a probation group evicted *because*
    probation was over its share leaves its digest in ``cut``; one evicted in LRU order in
    ``aged``; a protected group in ``protected``. A group stored again while in ``cut`` (the
    share cut it off too early) raises the share, one in ``protected`` (LRU order let a reused
    group go) lowers it, by the group's bytes over the pool's most bytes, times the other ghost's
    bytes over this one's when larger (ARC's ratio); a raise is further weighed by the share
    squared: a cut group that returns says a larger probation would have kept it, but at a small
    share most of them return after far more traffic than any share keeps (a conversation's next
    turn, minutes later: on Mooncake's conversation trace the unweighed rule climbed to half the
    pool and kept 1.16x LRU's block hits at 10% where a share of 0.1 to 0.3 keeps 1.31x), so the
    evidence counts in proportion to how much of the pool probation already holds; the share
    still climbs to 1 (LRU) where cut groups keep returning. ``aged`` teaches nothing (any share
    would have lost it) but still readmits to protected. The share starts at ``start`` and stays within
    ``[floor, 1]``: a floor keeps room for new chains, which every prefix trace needs to find its
    reused content at all. Leaf-first, pins and leases are the mechanism's; each call is the
    heaps' O(log n) plus O(1) ghost work."""

    name = "adaptive_slru"
    lanes = 2
    start = 0.5
    floor = 0.25
    dense = 2.0

    def __init__(self, cfg: CacheConfig, clock: Clock | None = None):
        super().__init__(cfg, clock)
        mods = list(cfg.modalities)
        self.share: dict[str, float] = {m: self.start for m in mods}
        self.peak: dict[str, int] = {m: 0 for m in mods}           # most bytes the pool held
        self._ghosts = {m: {k: Ghosts() for k in ("cut", "aged", "protected")} for m in mods}
        self._seen: dict[int, int] = {}                           # gid -> hits when last looked at
        self._over: dict[str, bool] = {}
        self._cut: set[int] = set()                               # victims handed out over the share

    # -- lanes
    def _new_lane(self, group: ModalityGroup) -> int:
        self._seen[group.gid] = group.hits
        m = group.modality
        held = sum(self.lane_bytes.of(t, m, lane) for t in Tier for lane in (PROBATION, PROTECTED))
        self.peak[m] = peak = max(self.peak[m], held + group.nbytes)
        if group.generated:                   # an answer: reused only if a next turn repeats it
            return PROBATION
        lane = PROTECTED if density(self.cfg, group) >= self.dense else PROBATION
        if group.key is None:
            return lane
        d = group.key.digest
        ghosts = self._ghosts[m]
        cut, protected = ghosts["cut"], ghosts["protected"]
        step = group.nbytes / peak
        if cut.take(d):
            ratio = max(1.0, protected.nbytes / max(cut.nbytes + group.nbytes, 1))
            # weighed by share squared: at a small share most cut groups that return do so
            # after far more traffic than any share would keep (turns minutes apart)
            self.share[m] = min(1.0, self.share[m] + ratio * step * self.share[m] ** 2)
            return PROTECTED
        if protected.take(d):
            ratio = max(1.0, cut.nbytes / max(protected.nbytes + group.nbytes, 1))
            self.share[m] = max(self.floor, self.share[m] - ratio * step)
            return PROTECTED
        if ghosts["aged"].take(d):
            return PROTECTED
        return lane

    def on_access(self, group: ModalityGroup) -> None:
        entry = self._entries.get(group.gid)
        if entry is not None and reused(self._seen, group):
            entry.lane = PROTECTED                # re-filed by the touch below
        super().on_access(group)

    def _key(self, entry) -> float:
        return float(self.tick)

    # -- victims
    def _plan(self, tier: Tier) -> None:
        self._over = {m: self.share[m] < 1.0 and self.lane_bytes.over(tier, m, PROBATION, self.share[m])
                      for m in self.cfg.modalities}

    def _rank(self, key: float, modality: str, lane: int = 0) -> float:
        return key - _FIRST if lane == PROBATION and self._over.get(modality, False) else key

    def victims(self, tier: Tier, bytes_needed: int, modality: str | None = None) -> list[ModalityGroup]:
        out = super().victims(tier, bytes_needed, modality)
        self._cut = {g.gid for g in out
                     if self._entries[g.gid].lane == PROBATION and self._over.get(g.modality, False)}
        return out

    def on_remove(self, group: ModalityGroup) -> None:
        entry = self._entries.get(group.gid)
        if entry is not None and group.key is not None:
            m = group.modality
            kind = ("protected" if entry.lane == PROTECTED
                    else "cut" if group.gid in self._cut else "aged")
            self._ghosts[m][kind].add(group.key.digest, group.nbytes, max(self.peak[m], group.nbytes))
        self._cut.discard(group.gid)
        super().on_remove(group)
        self._seen.pop(group.gid, None)
