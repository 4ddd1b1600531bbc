"""The recency and cost policies over the mechanism in ``base.py``: LRU, modality-priority LRU and
greedy-dual-size-frequency (cost-aware), each one ``_key`` (and maybe ``_rank``)."""

from __future__ import annotations

from ..config import CacheConfig
from ..core.groups import Tier
from .base import Clock, EvictionPolicy, PolicyEntry


class LRUPolicy(EvictionPolicy):
    """Least recently used group first (recency = the policy's logical clock at the last touch;
    a release counts as a touch, since the group was in use until then)."""

    name = "lru"

    def _key(self, entry: PolicyEntry) -> float:
        return float(self.tick)


class ModalityLRUPolicy(EvictionPolicy):
    """Modality-priority LRU. Rule: victims go in decreasing ``age / priority``, where ``age`` is
    the number of policy ticks (inserts, accesses, releases) since the group's last touch plus
    one, and ``priority`` is ``ModalitySpec.priority`` of its modality. Within one modality this
    is exactly LRU; across modalities a group of priority 4 survives as long as a group of
    priority 1 that is four times younger. With vision at 4 and audio at 1, the active
    conversation's images (touched at every turn) stay while audio of an old session goes first.
    """

    name = "modality_lru"

    def _key(self, entry: PolicyEntry) -> float:
        return float(self.tick)

    def _rank(self, key: float, modality: str, lane: int = 0) -> float:
        age = self.tick - key + 1.0
        return -age / self.cfg.modalities[modality].priority


class CostAwarePolicy(EvictionPolicy):
    """Greedy-dual-size-frequency. A group's priority at its latest touch is
    ``H = L[tier] + freq * recompute_cost / nbytes``, where ``freq`` counts its insert and
    accesses, ``recompute_cost = num_tokens * ModalitySpec.recompute_cost`` and ``nbytes`` its
    page bytes; lowest ``H`` goes first. ``L[tier]`` (the inflation value, one per tier) rises to
    the ``H`` of each group that leaves the tier, so groups not touched for a long time age out.
    ``H`` is scaled per MiB so that the ratios stay readable."""

    name = "cost_aware"

    def __init__(self, cfg: CacheConfig, clock: Clock | None = None):
        super().__init__(cfg, clock)
        self.inflation: dict[Tier, float] = {t: 0.0 for t in Tier}

    def _key(self, entry: PolicyEntry) -> float:
        g = entry.group
        return self.inflation[g.tier] + entry.freq * g.recompute_cost * (1 << 20) / max(g.nbytes, 1)

    def _left(self, tier: Tier, entry: PolicyEntry) -> None:
        if entry.key > self.inflation[tier]:
            self.inflation[tier] = entry.key
