"""``cluster/metrics.py`` through Ray's real metrics pipeline: an actor with a real cache
publishes its usage and event counters (``ActorMetrics``) and counts routing (``ClientMetrics``);
Ray's Prometheus endpoint of the node (a fresh local Ray, loopback) then serves exactly those
values: gauges as the cache's bytes and groups per tier and modality, counters as the growth of
the cache's cumulative counters (each event once, across publishes), publishing at most every
``min_interval_s``."""

from __future__ import annotations

import os
import socket
import time
import urllib.request

import pytest

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def endpoint():
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    old = os.environ.get("RAY_metrics_report_interval_ms")
    os.environ["RAY_metrics_report_interval_ms"] = "500"        # Ray's export interval, for this Ray
    port = _free_port()
    ray.init(address="local", num_cpus=1, include_dashboard=False, _metrics_export_port=port)
    yield f"http://127.0.0.1:{port}/metrics"
    ray.shutdown()
    if old is None:
        os.environ.pop("RAY_metrics_report_interval_ms", None)
    else:
        os.environ["RAY_metrics_report_interval_ms"] = old


class Probe:
    """An actor with a real cache and both metrics objects (what a pool actor and a client hold)."""

    def __init__(self, name: str):
        import torch

        from mmtier import CacheConfig, ModalitySpec, TieredKVCache
        from mmtier.cluster.metrics import ActorMetrics, ClientMetrics

        self.torch = torch
        self.cache = TieredKVCache(CacheConfig(
            model="m", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", device="cpu",
            modalities={"text": ModalitySpec(page_size=4), "vision": ModalitySpec(page_size=8)},
            device_bytes=1 << 20))
        self.actor = ActorMetrics(name, min_interval_s=0.0)
        self.client = ClientMetrics()

    def work(self, images: int, lookups: int) -> dict:
        """``images`` new vision groups, each looked up ``lookups`` times; one text sequence."""
        t = self.torch
        for i in range(images):
            key = self.cache.content_key("vision", os.urandom(8) + bytes([i]))
            self.cache.put(key, t.randn(1, 10, 1, 8), t.randn(1, 10, 1, 8))
            for _ in range(lookups):
                self.cache.contains(key)
        self.cache.contains(self.cache.content_key("vision", b"never stored"))
        seq = self.cache.create_sequence()
        self.cache.append(seq, "text", t.randn(1, 6, 1, 8), t.randn(1, 6, 1, 8))
        stats = self.cache.stats().to_dict()
        self.actor.publish(stats)
        return stats

    def route(self) -> None:
        self.client.hit("vision", True)
        self.client.hit("vision", True)
        self.client.hit("audio", False)
        self.client.copied("vision", 4096)
        self.client.remote("store", 3)

    def due_after_publish(self, interval: float) -> tuple[bool, bool]:
        from mmtier.cluster.metrics import ActorMetrics

        m = ActorMetrics("due-probe", min_interval_s=interval)
        first = m.due()
        m.publish({"tiers": {}, "by_modality": {}})
        return first, m.due()


def _samples(url: str, prefix: str) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(prefix):
                keep = {k: v for k, v in s.labels.items() if k in ("actor", "tier", "modality", "event", "holder_kind")}
                out[(s.name, frozenset(keep.items()))] = s.value
    return out


def _wait_for(url: str, prefix: str, want: dict, timeout: float = 60.0) -> dict:
    """Scrape until every wanted sample has its value (Ray exports every half second here)."""
    deadline = time.monotonic() + timeout
    while True:
        got = _samples(url, prefix)
        if all(got.get(k) == v for k, v in want.items()) or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def test_actor_metrics_export_usage_and_event_growth(endpoint):
    name = f"pool-{os.urandom(3).hex()}"
    probe = ray.remote(Probe).remote(name)
    first = ray.get(probe.work.remote(2, 3), timeout=120)
    second = ray.get(probe.work.remote(1, 1), timeout=120)       # counters grow; published again

    def key(metric, **labels):
        return (metric, frozenset({"actor": name, **labels}.items()))

    want = {}
    for tier, per in second["tiers"].items():
        for modality, usage in per.items():
            want[key("ray_mmtier_tier_bytes", tier=tier, modality=modality)] = float(usage["bytes"])
            want[key("ray_mmtier_tier_groups", tier=tier, modality=modality)] = float(usage["groups"])
    for modality, counts in second["by_modality"].items():
        for event in ("hits", "misses", "puts", "appended_tokens"):
            if counts.get(event):
                want[key("ray_mmtier_cache_events_total", event=event, modality=modality)] = float(counts[event])
    assert want[key("ray_mmtier_cache_events_total", event="hits", modality="vision")] == 7.0   # 2x3 + 1
    assert want[key("ray_mmtier_cache_events_total", event="puts", modality="vision")] == 3.0
    assert want[key("ray_mmtier_tier_groups", tier="device", modality="vision")] == 3.0
    assert first["by_modality"]["vision"]["hits"] == 6
    got = _wait_for(endpoint, "ray_mmtier_", want)
    assert {k: got.get(k) for k in want} == want


def test_client_metrics_and_the_publish_interval(endpoint):
    probe = ray.remote(Probe).remote(f"client-{os.urandom(3).hex()}")
    ray.get(probe.route.remote(), timeout=120)
    want = {("ray_mmtier_cluster_hits_total", frozenset({"modality": "vision"}.items())): 2.0,
            ("ray_mmtier_cluster_misses_total", frozenset({"modality": "audio"}.items())): 1.0,
            ("ray_mmtier_copies_total", frozenset({"modality": "vision"}.items())): 1.0,
            ("ray_mmtier_copy_bytes_total", frozenset({"modality": "vision"}.items())): 4096.0,
            ("ray_mmtier_remote_attentions_total", frozenset({"holder_kind": "store"}.items())): 3.0}
    got = _wait_for(endpoint, "ray_mmtier_", want)
    assert {k: got.get(k) for k in want} == want
    assert ray.get(probe.due_after_publish.remote(3600.0), timeout=60) == (True, False)
    assert ray.get(probe.due_after_publish.remote(0.0), timeout=60) == (True, True)
