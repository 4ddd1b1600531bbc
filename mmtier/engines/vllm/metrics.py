"""mmtier's cache on vLLM's own ``/metrics``: the connectors' statistics in vLLM's connector
metrics interfaces (``KVConnectorStats`` / ``KVConnectorPromMetrics`` for the KV connector, their
``EC`` twins for the encoder-cache connector).

A serving engineer scrapes vLLM's endpoint, not a second one: vLLM asks each connector for its
stats every step (the worker's and the scheduler's), ships them to its frontend with its own, and
hands them to the metrics the connector class registered, labelled like vLLM's own
(``model_name``, ``engine``). Under Ray Serve LLM vLLM passes Ray's metric types instead, and
the same metrics go out through Ray's Prometheus endpoint. The connector reports what its
process's cache counted since its last report (``engine_cache.report_for``: once per cache, at
most every second):

- ``vllm:mmtier_cache_events_total{event, modality}``: hits, misses, puts, evictions, spills,
  restores, corrupt reads, the write-behind's durable writes, bytes, dropped saves and failed
  writes, ... (``stats.report.EVENTS``);
- ``vllm:mmtier_phase_events_total{event, phase, modality}``: the puts and hits of the KV of
  prompts (``phase="prompt"``) and of generated tokens (``phase="decode"``, the connector's
  decode saves and the later turns that found them) apart;
- ``vllm:mmtier_tier_bytes{tier, modality}`` and ``vllm:mmtier_tier_groups{tier, modality}``:
  what the engine's caches hold in each tier now (summed over its processes' caches).

Both connectors feed the same metrics (created once per metric type, whichever connector class
vLLM asks first): where they share a cache (one extra config, as in
``configs/serve-llm-vllm.yaml``) its one report counts each event once.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.ec_transfer.ec_connector.metrics import (
    ECConnectorPromMetrics,
    ECConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)


def aggregate(a: dict, b: dict) -> dict:
    """Two reports as one: event growth summed, the latest usage of each cache."""
    events = dict(a.get("events", {}))
    for name, n in b.get("events", {}).items():
        events[name] = events.get(name, 0) + n
    return {"events": events, "usage": {**a.get("usage", {}), **b.get("usage", {})}}


def reduce(data: dict) -> dict[str, int | float]:
    """A report's totals for vLLM's log line: each event, and the bytes of each tier."""
    out: dict[str, int | float] = {}
    for name, n in data.get("events", {}).items():
        event = name.split("|", 1)[0]
        out[event] = out.get(event, 0) + n
    for per in data.get("usage", {}).values():
        for name, (nbytes, _groups) in per.items():
            key = name.split("|", 1)[0] + "_bytes"
            out[key] = out.get(key, 0) + nbytes
    return out


class MMTierKVStats(KVConnectorStats):
    """A report (``StatsReport.take``) of the KV connector's cache, or several aggregated."""

    def reset(self) -> None:
        self.data = {"events": {}, "usage": {}}

    def aggregate(self, other: KVConnectorStats) -> MMTierKVStats:
        return MMTierKVStats(data=aggregate(self.data, other.data))

    def reduce(self) -> dict[str, int | float]:
        return reduce(self.data)

    def is_empty(self) -> bool:
        return not self.data.get("events") and not self.data.get("usage")


class MMTierECStats(ECConnectorStats):
    """The same for the encoder-cache connector."""

    def reset(self) -> None:
        self.data = {"events": {}, "usage": {}}

    def aggregate(self, other: ECConnectorStats) -> MMTierECStats:
        return MMTierECStats(data=aggregate(self.data, other.data))

    def reduce(self) -> dict[str, int | float]:
        return reduce(self.data)

    def is_empty(self) -> bool:
        return not self.data.get("events") and not self.data.get("usage")


PHASED = ("puts", "hits")          # events counted per phase too (vllm:mmtier_phase_events)
_SHARED: dict[tuple[type, type, tuple[str, ...]], CacheMetrics] = {}


class CacheMetrics:
    """The metrics of the module doc for one set of metric types and labels (one per process,
    ``shared``), and the latest usage of each cache per engine."""

    def __init__(self, counter_cls: type, gauge_cls: type, labelnames: list[str]):
        self.events = counter_cls(
            name="vllm:mmtier_cache_events", documentation="mmtier cache events (hits, misses, puts, "
            "evictions, spills, restores, corrupt reads, ...) per modality.",
            labelnames=labelnames + ["event", "modality"])
        self.phases = counter_cls(
            name="vllm:mmtier_phase_events", documentation="mmtier puts and hits of the KV of prompts "
            "(phase prompt) and of generated tokens (phase decode) per modality.",
            labelnames=labelnames + ["event", "phase", "modality"])
        self.bytes = gauge_cls(
            name="vllm:mmtier_tier_bytes", documentation="Bytes the mmtier cache holds per tier and modality.",
            labelnames=labelnames + ["tier", "modality"], multiprocess_mode="mostrecent")
        self.groups = gauge_cls(
            name="vllm:mmtier_tier_groups", documentation="Groups the mmtier cache holds per tier and modality.",
            labelnames=labelnames + ["tier", "modality"], multiprocess_mode="mostrecent")
        self.usage: dict[int, dict[str, dict[str, list[int]]]] = {}     # engine -> cache -> usage

    @classmethod
    def shared(cls, counter_cls: type, gauge_cls: type, labelnames: list[str]) -> CacheMetrics:
        key = (counter_cls, gauge_cls, tuple(labelnames))
        if key not in _SHARED:
            _SHARED[key] = cls(counter_cls, gauge_cls, list(labelnames))
        return _SHARED[key]

    def observe(self, data: dict[str, Any], engine_idx: int, labels: list[object]) -> None:
        events = data.get("events", {})
        for name, n in events.items():
            event, modality = name.split("|", 1)
            self.events.labels(*labels, event, modality).inc(n)
            if event in PHASED:               # decode_<event> counts the generated tokens' share
                decode = min(n, events.get(f"decode_{event}|{modality}", 0))
                for phase, m in (("prompt", n - decode), ("decode", decode)):
                    if m:
                        self.phases.labels(*labels, event, phase, modality).inc(m)
        usage = self.usage.setdefault(engine_idx, {})
        usage.update(data.get("usage", {}))
        totals: dict[str, list[int]] = {}
        for per in usage.values():
            for name, (nbytes, groups) in per.items():
                t = totals.setdefault(name, [0, 0])
                t[0] += nbytes
                t[1] += groups
        for name, (nbytes, groups) in totals.items():
            tier, modality = name.split("|", 1)
            self.bytes.labels(*labels, tier, modality).set(nbytes)
            self.groups.labels(*labels, tier, modality).set(groups)


class MMTierPromMetrics(KVConnectorPromMetrics):
    """The KV connector's view of the process's ``CacheMetrics``."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.metrics = CacheMetrics.shared(self._counter_cls, self._gauge_cls, labelnames)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self.metrics.observe(transfer_stats_data, engine_idx, self.per_engine_labelvalues[engine_idx])


class MMTierECPromMetrics(ECConnectorPromMetrics):
    """The encoder-cache connector's view of the same ``CacheMetrics``."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.metrics = CacheMetrics.shared(self._counter_cls, self._gauge_cls, labelnames)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self.metrics.observe(transfer_stats_data, engine_idx, self.per_engine_labelvalues[engine_idx])
