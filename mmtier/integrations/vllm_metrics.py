"""mmtier's cache on vLLM's own ``/metrics``: the KV connector's statistics in vLLM's connector
metrics interface (``KVConnectorStats`` and ``KVConnectorPromMetrics``).

A serving engineer scrapes vLLM's endpoint, not a second one: vLLM asks each connector for its
stats every step (the worker's and the scheduler's), ships them to its frontend with its own, and
hands them to the metrics the connector class registered, labelled like vLLM's own
(``model_name``, ``engine``). Under Ray Serve LLM vLLM passes Ray's metric types instead, and
the same metrics go out through Ray's Prometheus endpoint. The connector reports what its
process's cache counted since its last report (``engine_cache.report_for``: once per cache, at
most every second):

- ``vllm:mmtier_cache_events_total{event, modality}``: hits, misses, puts, evictions, spills,
  restores, corrupt reads, ... (``stats_report.EVENTS``);
- ``vllm:mmtier_tier_bytes{tier, modality}`` and ``vllm:mmtier_tier_groups{tier, modality}``:
  what the engine's caches hold in each tier now (summed over its processes' caches).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)


class MMTierKVStats(KVConnectorStats):
    """A report (``StatsReport.take``) or several aggregated: event growth summed, the latest
    usage of each cache."""

    def reset(self) -> None:
        self.data = {"events": {}, "usage": {}}

    def aggregate(self, other: KVConnectorStats) -> MMTierKVStats:
        events = dict(self.data.get("events", {}))
        for name, n in other.data.get("events", {}).items():
            events[name] = events.get(name, 0) + n
        usage = {**self.data.get("usage", {}), **other.data.get("usage", {})}
        return MMTierKVStats(data={"events": events, "usage": usage})

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for name, n in self.data.get("events", {}).items():
            event = name.split("|", 1)[0]
            out[event] = out.get(event, 0) + n
        for per in self.data.get("usage", {}).values():
            for name, (nbytes, _groups) in per.items():
                key = name.split("|", 1)[0] + "_bytes"
                out[key] = out.get(key, 0) + nbytes
        return out

    def is_empty(self) -> bool:
        return not self.data.get("events") and not self.data.get("usage")


class MMTierPromMetrics(KVConnectorPromMetrics):
    """The metrics above, per vLLM engine."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._events = self._counter_cls(
            name="vllm:mmtier_cache_events", documentation="mmtier cache events (hits, misses, puts, "
            "evictions, spills, restores, corrupt reads, ...) per modality.",
            labelnames=labelnames + ["event", "modality"])
        self._bytes = self._gauge_cls(
            name="vllm:mmtier_tier_bytes", documentation="Bytes the mmtier cache holds per tier and modality.",
            labelnames=labelnames + ["tier", "modality"], multiprocess_mode="mostrecent")
        self._groups = self._gauge_cls(
            name="vllm:mmtier_tier_groups", documentation="Groups the mmtier cache holds per tier and modality.",
            labelnames=labelnames + ["tier", "modality"], multiprocess_mode="mostrecent")
        self._usage: dict[int, dict[str, dict[str, list[int]]]] = {}   # engine -> cache -> usage

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, n in transfer_stats_data.get("events", {}).items():
            event, modality = name.split("|", 1)
            self._events.labels(*labels, event, modality).inc(n)
        usage = self._usage.setdefault(engine_idx, {})
        usage.update(transfer_stats_data.get("usage", {}))
        totals: dict[str, list[int]] = {}
        for per in usage.values():
            for name, (nbytes, groups) in per.items():
                t = totals.setdefault(name, [0, 0])
                t[0] += nbytes
                t[1] += groups
        for name, (nbytes, groups) in totals.items():
            tier, modality = name.split("|", 1)
            self._bytes.labels(*labels, tier, modality).set(nbytes)
            self._groups.labels(*labels, tier, modality).set(groups)

