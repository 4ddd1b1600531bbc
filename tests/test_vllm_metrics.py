"""The engine's cache on vLLM's own ``/metrics``: mmtier's KV connector reports what its cache
counted through vLLM's connector-stats interface, and the metrics its class registers (built by
vLLM's ``KVConnectorProm``, as vLLM's Prometheus stat logger does) show exactly the cache's
counters and usage in Prometheus text; the scheduler and the worker of one process share one
cache, and each event is reported once."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.metrics",
                    reason="vLLM is not importable: run ./run engines (an overlay venv with vLLM and SGLang, no CUDA); ./run test then runs this file there")

from prometheus_client import REGISTRY, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm  # noqa: E402

from mmtier.integrations.engine_cache import close_shared  # noqa: E402
from tests import vllm_harness as h  # noqa: E402


def scrape() -> dict[tuple[str, tuple], float]:
    """Every mmtier sample of the process's Prometheus registry, as vLLM's /metrics serves it."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in family.samples:
            if s.name.startswith("vllm:mmtier"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_the_cache_counters_reach_vllms_prometheus_metrics(tmp_path):
    fields = h.cache_fields(tmp_path / "spill")
    cfg = h.vllm_config(fields)
    sched, worker = h.connectors(fields)
    try:
        assert sched.cache is worker.cache
        prom = KVConnectorProm(cfg, ["model_name", "engine"], {0: ["tiny-vllm", "0"]})
        assert prom.prom_metrics is not None                      # the class registered its metrics
        kv = h.paged(seed=3)
        assert h.step(sched, worker, h.request("r1", seed=5), list(range(6)), kv) == 0     # saved
        assert h.step(sched, worker, h.request("r2", seed=5), list(range(6, 12)), h.paged()) == 40  # hit
        first = worker.get_kv_connector_stats()                   # what the model runner asks
        assert first is not None and not first.is_empty()
        assert sched.get_kv_connector_stats() is None             # the same cache: reported once
        stats = type(first)(data=first.to_dict())                 # as the frontend rebuilds it
        prom.observe(stats.to_dict(), 0)

        want = sched.cache.stats()
        got = scrape()
        labels = (("engine", "0"), ("model_name", "tiny-vllm"))
        for modality, counts in want.by_modality.items():
            for event in ("hits", "misses", "puts"):
                key = ("vllm:mmtier_cache_events_total", tuple(sorted((*labels, ("event", event), ("modality", modality)))))
                assert got.get(key, 0.0) == counts.get(event, 0), (event, modality)
        assert sum(c.get("hits", 0) for c in want.by_modality.values()) >= 3    # r2's three groups
        for tier, per in want.tiers.items():
            for modality, usage in per.items():
                where = tuple(sorted((*labels, ("modality", modality), ("tier", tier))))
                assert got[("vllm:mmtier_tier_bytes", where)] == usage.bytes
                assert got[("vllm:mmtier_tier_groups", where)] == usage.groups
        assert got[("vllm:mmtier_tier_bytes", tuple(sorted((*labels, ("modality", "text"), ("tier", "device")))))] > 0

        # the next report carries only what happened since: another hit, counted once more
        sched.report.min_interval_s = 0.0
        before = got
        assert h.step(sched, worker, h.request("r3", seed=5), list(range(12, 18)), h.paged()) == 40
        prom.observe(sched.get_kv_connector_stats().to_dict(), 0)
        after = scrape()
        hits = {k: v for k, v in after.items() if k[0] == "vllm:mmtier_cache_events_total" and ("event", "hits") in k[1]}
        grew = sum(v - before.get(k, 0.0) for k, v in hits.items())
        now = sched.cache.stats()
        assert grew == now.counters.get("hits", 0) - want.counters.get("hits", 0) > 0
        assert stats.reduce()["hits"] == want.counters["hits"]
    finally:
        worker.shutdown()
        close_shared()
        for name in ("vllm:mmtier_cache_events", "vllm:mmtier_tier_bytes", "vllm:mmtier_tier_groups"):
            collector = REGISTRY._names_to_collectors.get(name) or REGISTRY._names_to_collectors.get(name + "_total")
            if collector is not None:
                REGISTRY.unregister(collector)

