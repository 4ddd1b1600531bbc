"""Engines that hold their own pool (``PoolHost``) on a real two-node cluster on loopback.

The reference model runs in ``ReferenceEngine`` actors named as pools (``host_name``): its
attention reads the embedded cache with no Ray call; the cluster traffic of a turn (counted by
the engine's ``RayTransport``) is at most one registry lookup, one fetch per remote media group
and one publish. Every turn's tokens are checked against the dense model (no cache).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import random  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

import mmtier.actors as mma  # noqa: E402
from mmtier.actors import ClusterSettings  # noqa: E402
from mmtier.actors.pool_host import host_name  # noqa: E402
from mmtier.models import Audio, Image, ReferenceModel, Text  # noqa: E402
from mmtier.models.engine import ReferenceEngine  # noqa: E402

pytestmark = pytest.mark.ray

SETTINGS = ClusterSettings(namespace="mmtier-host-test", device_resource="no_such_device", sweep_interval_s=0.5,
                           ping_timeout_s=1.0, sweep_misses=2, call_timeout_s=20.0)
MODEL = ReferenceModel(seed=0)


def _blob(tag: str, n: int) -> bytes:
    r = random.Random(f"{tag}:{time.time_ns()}")             # fresh media every run
    return bytes(r.getrandbits(8) for _ in range(n))


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"node_a": 1}, "object_store_memory": 80 << 20, "include_dashboard": False})
    c.add_node(num_cpus=1, resources={"node_b": 1}, object_store_memory=80 << 20)
    c.wait_for_nodes()
    ray.init(address=c.address, namespace=SETTINGS.namespace, include_dashboard=False)
    mma.start(MODEL.cache_config(device_bytes=6 << 20), SETTINGS)
    nodes = {r: n["NodeID"] for n in ray.nodes() for r in ("node_a", "node_b") if r in n["Resources"]}
    yield nodes
    mma.shutdown(SETTINGS)
    ray.shutdown()
    c.shutdown()


def _engine(node: str, index: int = 0):
    return ray.remote(ReferenceEngine).options(
        name=host_name(node, index), namespace=SETTINGS.namespace, num_cpus=0, max_concurrency=4,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote(SETTINGS.model_dump(mode="json"))


def _turn(engine, sid, prompt, n):
    return ray.get(engine.turn.remote(sid, prompt, n), timeout=120)


def test_decode_over_local_groups_makes_no_ray_call(cluster):
    eng = _engine(cluster["node_a"])
    img, clip = Image(_blob("img", 3072)), Audio(_blob("clip", 1600))
    turns = [[Text("Look: "), img, Text(" and listen: "), clip], [Text("What is it? ")]]
    sid = ray.get(eng.open.remote("acme"), timeout=60)
    first = _turn(eng, sid, turns[0], 16)
    assert first["counters"]["encoder_runs"] == {"vision": 1, "audio": 1}
    assert first["calls"] == {"lookup": 1, "publish": 1}        # 4 new groups, one publish
    second = _turn(eng, sid, turns[1], 16)                     # 16 decode steps over local groups
    assert second["calls"] == {}                               # no Ray call at all
    assert second["counters"]["decoder_tokens"] >= 16
    assert [first["tokens"], second["tokens"]] == MODEL.chat_dense(turns, 16)
    ray.kill(eng)


@pytest.mark.parametrize("new_tokens", [2, 12])
def test_remote_media_groups_cost_one_lookup_n_fetches_one_publish(cluster, new_tokens):
    a, b = _engine(cluster["node_a"], 1), _engine(cluster["node_b"], 1)
    img, clip = Image(_blob("img", 3072)), Audio(_blob("clip", 2400))
    prompt = [Text("Look: "), img, Text(" hear: "), clip]
    sa = ray.get(a.open.remote("acme"), timeout=60)
    want = MODEL.chat_dense([prompt], new_tokens)[0]
    assert _turn(a, sa, prompt, new_tokens)["tokens"] == want
    ray.get(a.close_session.remote(sa), timeout=60)
    sb = ray.get(b.open.remote("acme"), timeout=60)            # the other node, same media
    got = _turn(b, sb, prompt, new_tokens)
    assert got["tokens"] == want
    assert got["counters"]["encoder_runs"] == {}               # nothing encoded again
    assert got["counters"]["cross_hits"] == {"vision": 1, "audio": 1}
    # cross K/V and encoder outputs of two media: 4 groups, each fetched once
    assert got["calls"] == {"lookup": 1, "fetch": 4, "publish": 1}
    stats = ray.get(b.stats.remote(), timeout=60)["host"]
    assert stats["fetched"] == 4 and stats["plan_fetch"] == 4 and stats.get("plan_remote", 0) == 0
    assert ray.get(a.leak_report.remote(), timeout=60)["leases"] == 0   # every export's lease back
    ray.kill(a)
    ray.kill(b)


def test_transfer_plan_fetches_what_fits_and_attends_huge_cold_groups_in_place():
    from mmtier.actors.placement import transfer_plan

    plan = lambda nbytes, calls: transfer_plan(nbytes, 64 << 20, calls, link_bytes_per_s=1e9, call_s=1e-3)  # noqa: E731
    assert plan(8 << 20, 0) == "fetch"                 # fits easily: always pulled whole
    assert plan(100 << 20, 10_000) == "remote"         # larger than the local arena
    assert plan(40 << 20, 4) == "remote"               # large, and 42 ms to move > 4 calls left
    assert plan(40 << 20, 1_000) == "fetch"            # large, but a long turn pays the move back


def test_spilled_group_comes_back_from_the_node_store(cluster):
    """The embedded pool spills to its node's store and restores from it through the turn's
    lookup (a fetch from the store), with the same tokens as the dense model."""
    eng = _engine(cluster["node_a"], 2)
    img = Image(_blob("img", 3072))
    prompt = [Text("Look: "), img]
    want = MODEL.chat_dense([prompt], 4)[0]
    sid = ray.get(eng.open.remote("acme"), timeout=60)
    first = _turn(eng, sid, prompt, 4)
    assert first["tokens"] == want
    ray.get(eng.close_session.remote(sid), timeout=60)
    moved, nbytes = ray.get(eng.spill.remote(first["xkeys"]), timeout=60)
    assert moved == 1 and nbytes > 0
    sid = ray.get(eng.open.remote("acme"), timeout=60)
    again = _turn(eng, sid, prompt, 4)
    assert again["tokens"] == want
    assert again["counters"]["cross_hits"] == {"vision": 1}
    assert again["calls"] == {"lookup": 1, "fetch": 1, "publish": 1}     # back from the store
    ray.kill(eng)


def test_export_buffer_holds_its_lease_and_imports_land_in_scattered_pages():
    """No Ray: an export's buffer is a view of the arena leased exactly as long as it lives (the
    group cannot leave meanwhile); an import into scattered pages, run by run, stores the same
    K/V; a key not held raises and leaves no lease."""
    from mmtier.actors.pool_actor import PoolService, page_runs
    from mmtier.actors.transfer import export_to_object_store
    from mmtier.errors import UnknownKeyError

    cfg = MODEL.cache_config(device_bytes=6 << 20)
    src, dst = PoolService(cfg, name="src", node="n"), PoolService(cfg, name="dst", node="n")
    spec = cfg.spec("vision")
    k = torch.randn(spec.num_layers, 3 * spec.page_size - 5, spec.num_kv_heads, spec.head_dim)
    v = torch.randn_like(k)
    key = src.cache.content_key("vision", _blob("scatter", 64), tenant="acme")
    src.put(key.to_wire(), k, v)
    # the destination's vision pool full of one-page groups, every other one dropped
    one = [dst.cache.content_key("vision", _blob(f"fill{i}", 64), tenant="acme")
           for i in range(dst.cache.pools["vision"].num_pages)]
    for f in one:
        dst.put(f.to_wire(), *(torch.randn(spec.num_layers, 7, spec.num_kv_heads, spec.head_dim),) * 2)
    assert dst.drop([f.to_wire() for f in one[::2]]) == [f.hex for f in one[::2]]

    meta, buf = export_to_object_store(src, key.to_wire())
    assert len(src.cache.leases) == 1
    assert src.drop([key.to_wire()]) == []                     # leased: cannot leave
    assert np.shares_memory(buf, src.cache.pools["vision"].view.numpy())   # a view, no copy
    item, _ = dst.import_group(key.to_wire(), meta, buf)
    assert item is not None and item["num_tokens"] == k.shape[1]
    del buf                                                    # the last reference: lease back
    assert len(src.cache.leases) == 0
    assert len(page_runs(dst.cache._groups[key].pages)) > 1    # landed in scattered pages
    got_k, got_v = dst.cache.read_group(key)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert src.drop([key.to_wire()]) == [key.hex]
    with pytest.raises(UnknownKeyError):
        export_to_object_store(src, key.to_wire())
    assert len(src.cache.leases) == 0
    assert dst.leak_report()["leases"] == 0
