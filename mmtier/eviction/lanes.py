"""What the two-queue policies (S3-FIFO, ARC, adaptive SLRU) share: bytes per lane, ghosts,
reuse, cost density.

``LaneBytes`` counts the bytes of the groups in each ``(tier, modality, lane)`` (the mechanism
keeps one, ``EvictionPolicy.lane_bytes``, for policies with more than one lane), their total and
its high-water mark (``peak``: the tiers' size once they have filled, what ghosts and targets
are measured against); ``Ghosts`` remembers the digests of groups a lane lost, with their
bytes, first in first out, bounded in bytes; ``density`` is a group's recompute cost per byte
relative to the config's cheapest modality (a page of image KV costs more to recompute than a
page of text; a half-empty page of a 16-token chunk less).
"""

from __future__ import annotations

from collections import OrderedDict

from ..config import CacheConfig
from ..core.groups import ModalityGroup, Tier

Place = tuple[Tier, str, int]


class LaneBytes:
    def __init__(self) -> None:
        self.bytes: dict[Place, int] = {}
        self.sum = 0
        self.peak = 0
        self._at: dict[int, tuple[Place, int]] = {}         # gid -> (where it is counted, bytes)

    def place(self, gid: int, where: Place, nbytes: int) -> None:
        old = self._at.get(gid)
        if old is not None and old == (where, nbytes):
            return
        if old is not None:
            self.bytes[old[0]] -= old[1]
            self.sum -= old[1]
        self._at[gid] = (where, nbytes)
        self.bytes[where] = self.bytes.get(where, 0) + nbytes
        self.sum += nbytes
        self.peak = max(self.peak, self.sum)

    def drop(self, gid: int) -> None:
        old = self._at.pop(gid, None)
        if old is not None:
            self.bytes[old[0]] -= old[1]
            self.sum -= old[1]

    def of(self, tier: Tier, modality: str, lane: int) -> int:
        return self.bytes.get((tier, modality, lane), 0)

    def over(self, tier: Tier, modality: str, lane: int, fraction: float, lanes: int = 2) -> bool:
        """Whether ``lane`` holds more than ``fraction`` of the bytes of the ``lanes`` lanes of
        ``(tier, modality)``."""
        mine = self.of(tier, modality, lane)
        return mine > fraction * sum(self.of(tier, modality, j) for j in range(lanes))



class Ghosts:
    """Digests of groups that left, oldest first, at most ``limit`` bytes of them."""

    def __init__(self) -> None:
        self._items: OrderedDict[bytes, int] = OrderedDict()
        self.nbytes = 0

    def add(self, digest: bytes, nbytes: int, limit: int) -> None:
        old = self._items.pop(digest, None)
        if old is not None:
            self.nbytes -= old
        self._items[digest] = nbytes
        self.nbytes += nbytes
        self.trim(limit)

    def take(self, digest: bytes) -> bool:
        """Whether ``digest`` was remembered (it is forgotten now)."""
        nbytes = self._items.pop(digest, None)
        if nbytes is None:
            return False
        self.nbytes -= nbytes
        return True

    def trim(self, limit: int) -> None:
        while self.nbytes > limit and self._items:
            _, nbytes = self._items.popitem(last=False)
            self.nbytes -= nbytes

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._items


def reused(seen: dict[int, int], group: ModalityGroup) -> bool:
    """Whether a later lookup found ``group`` since ``seen`` last noted its hits (noted now):
    a two-lane policy's signal to move it to its reuse lane (ARC's frequent, SLRU's protected)."""
    if group.hits <= seen.get(group.gid, 0):
        return False
    seen[group.gid] = group.hits
    return True


def density(cfg: CacheConfig, group: ModalityGroup) -> float:
    """Recompute cost per byte of ``group`` over the best a page of the cheapest modality gets."""
    ref = min(s.recompute_cost / s.token_bytes for s in cfg.modalities.values())
    return group.recompute_cost / max(group.nbytes, 1) / max(ref, 1e-12)
