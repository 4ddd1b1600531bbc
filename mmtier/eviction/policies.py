"""The shipped eviction policies: each is one ``_key`` (and maybe ``_rank``) over the mechanism
in ``base.py``; a new policy is one class here plus one line in ``POLICIES`` (and its name in
``config.POLICIES``)."""

from __future__ import annotations

from ..config import CacheConfig
from ..groups import ModalityGroup, Tier
from .base import Clock, EvictionPolicy, _Entry


class LRUPolicy(EvictionPolicy):
    """Least recently used group first (recency = the policy's logical clock at the last touch;
    a release counts as a touch, since the group was in use until then)."""

    name = "lru"

    def _key(self, entry: _Entry) -> float:
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

    def _key(self, entry: _Entry) -> float:
        return float(self.tick)

    def _rank(self, key: float, modality: str) -> float:
        age = self.tick - key + 1.0
        return -age / self.cfg.modalities[modality].priority


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

    def _key(self, entry: _Entry) -> float:
        g = entry.group
        if g.hits > 0 or self._admitted.get(g.gid, True):
            return float(self.tick)
        return float(self.tick) - self._UNADMITTED


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

    def _key(self, entry: _Entry) -> float:
        g = entry.group
        return self.inflation[g.tier] + entry.freq * g.recompute_cost * (1 << 20) / max(g.nbytes, 1)

    def _left(self, tier: Tier, entry: _Entry) -> None:
        if entry.key > self.inflation[tier]:
            self.inflation[tier] = entry.key


POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "modality_lru": ModalityLRUPolicy,
    "cost_aware": CostAwarePolicy,
    "bimodal_lru": BimodalLRUPolicy,
}


def make_policy(cfg: CacheConfig, clock: Clock | None = None) -> EvictionPolicy:
    try:
        cls = POLICIES[cfg.eviction_policy]
    except KeyError:
        from ..errors import ConfigError

        raise ConfigError(f"eviction_policy {cfg.eviction_policy!r} is not implemented",
                          ("eviction_policy",)) from None
    return cls(cfg, clock)
