"""The engine's cache on vLLM's own ``/metrics``: mmtier's KV and encoder-cache connectors report
what their cache counted through vLLM's connector-stats interfaces, and the metrics their classes
register (built by vLLM's ``KVConnectorProm`` / ``ECConnectorProm``, as vLLM's Prometheus stat
logger does) show exactly the cache's counters and usage in Prometheus text; connectors that
share a cache (scheduler and worker, KV and EC) report each event once."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.metrics",
                    reason="vLLM is not importable: run ./run engines (.venv-engines: a real vLLM engine, its CPU build here, and SGLang); ./run test then runs this file there")

import torch  # noqa: E402
from prometheus_client import REGISTRY, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorProm  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm  # noqa: E402

from mmtier.engines.connector_cache import close_shared  # noqa: E402
from mmtier.engines.vllm import metrics as vllm_metrics  # noqa: E402
from tests.support import vllm_harness as h  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_metrics():
    """Each test registers the metrics anew (vLLM registers them once per process)."""
    yield
    close_shared()
    for collector in {id(c): c for n, c in REGISTRY._names_to_collectors.items()
                      if n.startswith("vllm:mmtier")}.values():
        REGISTRY.unregister(collector)
    vllm_metrics._SHARED.clear()


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


def test_the_encoder_cache_connector_feeds_the_same_metrics(tmp_path):
    from vllm.config import DeviceConfig, ECTransferConfig, VllmConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    from tests.support.engine_shapes import EMBED_WIDTH, with_embeddings

    fields = with_embeddings(h.cache_fields(tmp_path / "spill"))
    kv_cfg = h.vllm_config(fields)
    sched, worker = h.connectors(fields)                        # the KV connectors, one cache
    ec = ECTransferConfig(ec_connector="MMTierECConnector", ec_role="ec_both",
                          ec_connector_module_path="mmtier.engines.vllm.ec",
                          ec_connector_extra_config={"mmtier_cache": fields, "mmtier_tenant": "acme"})
    ec_cfg = VllmConfig(ec_transfer_config=ec, device_config=DeviceConfig(device="cpu"))
    ec_cfg.parallel_config.distributed_executor_backend = "uni"   # both roles in this process
    ec_sched, ec_worker = (ECConnectorFactory.create_connector(ec_cfg, r)
                           for r in (ECConnectorRole.SCHEDULER, ECConnectorRole.WORKER))
    try:
        assert ec_sched.cache is sched.cache                   # one extra config: one cache
        kv_prom = KVConnectorProm(kv_cfg, ["model_name", "engine"], {0: ["tiny-vllm", "0"]})
        ec_prom = ECConnectorProm(ec_cfg, ["model_name", "engine"], {0: ["tiny-vllm", "0"]})
        assert kv_prom.prom_metrics.metrics is ec_prom.prom_metrics.metrics   # no second registration
        from tests.engines.test_vllm_ec_connector import pixels, request, run

        x = torch.randn(16, EMBED_WIDTH)
        assert not run(ec_sched, ec_worker, request("m1", "img-m", pixels(3)), {}, computed=x)   # saved
        assert run(ec_sched, ec_worker, request("m2", "img-m", pixels(3)), {})                   # a hit
        data = ec_sched.get_ec_connector_stats()
        assert data is not None and sched.get_kv_connector_stats() is None   # reported once
        ec_prom.observe(data.data, 0)                          # what vLLM ships (stats.data)
        got = scrape()
        labels = (("engine", "0"), ("model_name", "tiny-vllm"))
        want = sched.cache.stats().by_modality["vision_embed"]
        for event in ("hits", "puts"):
            key = ("vllm:mmtier_cache_events_total",
                   tuple(sorted((*labels, ("event", event), ("modality", "vision_embed")))))
            assert got[key] == want[event] > 0
    finally:
        worker.shutdown()
