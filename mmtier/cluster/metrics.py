"""Metrics through ``ray.util.metrics`` (exported by Ray's Prometheus endpoint).

Two sources. The client counts what it routes: hits and misses per modality, remote partial
attentions, copies and copied bytes between actors. Pool and store actors publish their caches'
usage (bytes and groups per tier and modality, as gauges) and event counters (spills, restores,
evictions, corrupt reads, ...: the cumulative counters of ``CacheStats``, turned into increments
here) whenever the registry's liveness sweep pings them, at most every ``min_interval_s``.
"""

from __future__ import annotations

import time

from ray.util import metrics as rm

from ..stats.report import increments


class ClientMetrics:
    """What the client routes."""

    def __init__(self) -> None:
        tags = ("modality",)
        self.hits = rm.Counter("mmtier_cluster_hits", "Registry lookups that found a holder.", tags)
        self.misses = rm.Counter("mmtier_cluster_misses", "Registry lookups that found none.", tags)
        self.remote_attentions = rm.Counter(
            "mmtier_remote_attentions", "Partial attentions computed on another actor than the home pool.",
            ("holder_kind",))
        self.copies = rm.Counter("mmtier_copies", "Groups copied between actors (object store).", tags)
        self.copy_bytes = rm.Counter("mmtier_copy_bytes", "Bytes of groups copied between actors.", tags)

    def hit(self, modality: str, hit: bool) -> None:
        (self.hits if hit else self.misses).inc(1, tags={"modality": modality})

    def remote(self, holder_kind: str, n: int = 1) -> None:
        self.remote_attentions.inc(n, tags={"holder_kind": holder_kind})

    def copied(self, modality: str, nbytes: int) -> None:
        self.copies.inc(1, tags={"modality": modality})
        self.copy_bytes.inc(nbytes, tags={"modality": modality})


class ActorMetrics:
    """What a pool or store holds and what its cache counted."""

    def __init__(self, actor: str, min_interval_s: float = 5.0) -> None:
        self.actor = actor
        self.min_interval_s = min_interval_s
        self._last: float | None = None              # never published: due at once
        self._seen: dict[tuple[str, str], int] = {}
        tags = ("actor", "tier", "modality")
        self.bytes = rm.Gauge("mmtier_tier_bytes", "Bytes held per tier and modality.", tags)
        self.groups = rm.Gauge("mmtier_tier_groups", "Groups held per tier and modality.", tags)
        self.events = rm.Counter("mmtier_cache_events", "Cache events (hits, spills, restores, "
                                 "evictions, corrupt_reads, ...) per modality.",
                                 ("actor", "event", "modality"))

    def due(self) -> bool:
        return self._last is None or time.monotonic() - self._last >= self.min_interval_s

    def publish(self, stats: dict) -> None:
        """``stats``: ``CacheStats.to_dict()`` of the actor's cache."""
        self._last = time.monotonic()
        for tier, per in stats.get("tiers", {}).items():
            for modality, usage in per.items():
                tags = {"actor": self.actor, "tier": tier, "modality": modality}
                self.bytes.set(usage["bytes"], tags=tags)
                self.groups.set(usage["groups"], tags=tags)
        for (event, modality), n in increments(self._seen, stats.get("by_modality", {})).items():
            self.events.inc(n, tags={"actor": self.actor, "event": event, "modality": modality})
