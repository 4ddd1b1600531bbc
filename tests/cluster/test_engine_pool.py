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

import mmtier.cluster as mma  # noqa: E402
from mmtier.cluster import ClusterSettings  # noqa: E402
from mmtier.cluster.engine_pool import PoolHost, host_name  # noqa: E402
from tests.support.reference_model import Audio, Image, ReferenceModel, Text  # noqa: E402
from tests.support.reference_model.engine import ReferenceEngine  # noqa: E402

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
    from mmtier.cluster.client_placement import transfer_plan

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
    from mmtier.cache.page_io import page_runs
    from mmtier.cluster.pool import PoolService
    from mmtier.cluster.transfer import export_to_object_store
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
    assert dst.drop([f.to_wire() for f in one[::2]]) == [f.address for f in one[::2]]

    meta, buf = export_to_object_store(src, key.to_wire())
    assert len(src.cache.leases) == 1
    assert src.drop([key.to_wire()]) == []                     # leased: cannot leave
    assert np.shares_memory(buf, src.cache.pools["vision"].view.numpy())   # a view, no copy
    item, _ = dst.import_group(key.to_wire(), meta, buf)
    assert item is not None and item["num_tokens"] == k.shape[1]
    del buf                                                    # the last reference: lease back
    assert len(src.cache.leases) == 0
    assert len(page_runs(dst.cache.index.groups[key].pages)) > 1    # landed in scattered pages
    got_k, got_v = dst.cache.read_group(key)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert src.drop([key.to_wire()]) == [key.address]
    with pytest.raises(UnknownKeyError):
        export_to_object_store(src, key.to_wire())
    assert len(src.cache.leases) == 0
    assert dst.leak_report()["leases"] == 0


class _Probe(PoolHost):
    """An engine reduced to the cache calls its model makes, driven by the test."""

    def capacity(self, modality: str) -> int:
        pool = self.cache.pools[modality]
        return pool.num_pages * pool.spec.page_bytes

    def store(self, blob: bytes, n: int) -> dict:
        """Put a fresh vision group of ``n`` tokens here and publish it; its key's wire form."""
        spec = self.cache.cfg.spec("vision")
        key = self.local.content_key("vision", blob, tenant="acme")
        self.local.put(key, *_kv(spec, n))
        self.local.end_turn()
        return key.to_wire()

    def pull(self, wire, holder: str | None) -> tuple[bool, bool, dict]:
        """``fetch`` from ``holder`` (None: through the turn's lookup, then ``contains``);
        ``(fetched, held now, turn stats)``."""
        from mmtier.content import ContentKey

        key = ContentKey.from_wire(wire)
        if holder is None:
            self.local.begin_turn([key])
            got = self.local.contains(key)
            self.local.end_turn()
        else:
            got = self.local.fetch(key, holder)
        return got, self.holds([wire])[0], self.local.turn_stats()

    def turn(self, wire, before, after, queries):
        """A turn over ``before`` text, the group, ``after`` text; ``queries``: ``(layer, q,
        positions or None, causal, groups or None)``. Answers the states, the sequence's length,
        the plan and the Ray calls per kind made by the attention calls alone."""
        from mmtier.content import ContentKey

        key, local = ContentKey.from_wire(wire), self.local
        local.begin_turn([key], calls_left=len(queries))
        assert local.contains(key)
        seq = local.create_sequence("acme")
        local.append(seq, "text", *before)
        local.attach(seq, key)
        local.append(seq, "text", *after)
        calls = dict(self.transport.calls)
        states = [local.attention_state(seq, layer, q, q_positions=pos, causal=causal,
                                        groups=None if groups is None else [ContentKey.from_wire(g) for g in groups])
                  for layer, q, pos, causal, groups in queries]
        during = {k: n - calls.get(k, 0) for k, n in self.transport.calls.items() if n != calls.get(k, 0)}
        length = local.sequence(seq).length
        local.release(seq)
        local.end_turn()
        return states, length, dict(local.plan), during, local.turn_stats()


def _kv(spec, n):
    k = torch.randn(spec.num_layers, n, spec.num_kv_heads, spec.head_dim)
    return k, torch.randn_like(k)


@pytest.mark.parametrize("fits", [False, True])
def test_group_too_large_for_the_pool_is_attended_at_its_holder(cluster, fits):
    """A group held on node B and larger than the engine's pool on node A is attended where it
    lives (one ``attend`` per attention call, merged exactly with the local text before and
    after it); one that fits is fetched instead. Both equal the float64 oracle."""
    from tests.support.oracle import oracle_attention, rel_err

    cc = mma.connect(SETTINGS)
    small = ray.remote(_Probe).options(
        name=host_name(cluster["node_a"], 7), namespace=SETTINGS.namespace, num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(cluster["node_a"], soft=False),
    ).remote(SETTINGS, device_bytes=1 << 20)
    spec, text = cc.cfg.spec("vision"), cc.cfg.spec("text")
    cap = ray.get(small.capacity.remote("vision"), timeout=60)
    n_group = 40 if fits else cap // spec.token_bytes + 3 * spec.page_size     # over the arena
    key = cc.content_key("vision", _blob("huge", 256), tenant="acme")
    gk, gv = _kv(spec, n_group)
    assert cc.put(key, gk, gv, node=cluster["node_b"])
    before, after = _kv(text, 21), _kv(text, 11)
    total = 21 + n_group + 11
    layers = [0, spec.num_layers - 1]
    hq = 2 * spec.num_kv_heads
    queries = [(layer, torch.randn(n_q, hq, spec.head_dim), pos, causal, groups)
               for layer in layers
               for n_q, pos, causal, groups in [
                   (3, None, True, None),                                        # the last positions
                   (5, torch.tensor([4, 20, 21 + n_group // 2, 21 + n_group, total - 1]), True, None),
                   (2, None, False, [key.to_wire()])]]                           # the group alone
    states, length, plan, during, stats = ray.get(small.turn.remote(key.to_wire(), before, after, queries),
                                                  timeout=120)
    assert length == total
    for (layer, q, pos, causal, groups), (out, lse) in zip(queries, states):
        ks = torch.cat([before[0][layer], gk[layer], after[0][layer]])
        vs = torch.cat([before[1][layer], gv[layer], after[1][layer]])
        kpos = torch.arange(total)
        if groups is not None:
            ks, vs, kpos = ks[21:21 + n_group], vs[21:21 + n_group], kpos[21:21 + n_group]
        qpos = torch.arange(total - q.shape[0], total) if pos is None else pos
        want_out, want_lse = oracle_attention(q, qpos, ks, vs, kpos, causal=causal)
        assert rel_err(out, want_out) < 1e-4 and rel_err(lse, want_lse) < 1e-4
    if fits:
        assert plan == {key.hex: "fetch"} and stats["fetched"] == 1 and stats.get("plan_remote", 0) == 0
        assert during == {}                                   # attended here: no Ray call
    else:
        assert plan == {key.hex: "remote"} and stats.get("fetched", 0) == 0
        assert stats["plan_remote"] == 1 and stats["remote_attaches"] == 1
        assert during == {"attend": len(queries)}             # one call per attention call
        assert stats["calls_release"] == 1                    # the proxy let go at release
    b_pool = cc.pools(cluster["node_b"])[0]
    leaks = ray.get(ray.get_actor(b_pool, namespace=SETTINGS.namespace).leak_report.remote(), timeout=60)
    assert leaks["leases"] == 0
    ray.kill(small)
    cc.close()


def test_a_failed_fetch_is_a_miss_and_leaks_nothing(cluster):
    """A holder that died before the fetch (named, or still listed by the registry): the fetch
    is a miss counted by kind, never an exception; the receiver's pages and leases are as
    before, and a live holder's export leaves no lease behind."""
    opts = dict(namespace=SETTINGS.namespace, num_cpus=0)
    a = ray.remote(_Probe).options(name=host_name(cluster["node_a"], 8), scheduling_strategy=NodeAffinitySchedulingStrategy(
        cluster["node_a"], soft=False), **opts).remote(SETTINGS)
    b = ray.remote(_Probe).options(name=host_name(cluster["node_b"], 8), scheduling_strategy=NodeAffinitySchedulingStrategy(
        cluster["node_b"], soft=False), **opts).remote(SETTINGS)
    wire = ray.get(b.store.remote(_blob("lost", 64), 70), timeout=60)
    ok = ray.get(b.store.remote(_blob("kept", 64), 70), timeout=60)
    before = ray.get(a.leak_report.remote(), timeout=60)
    got, held, _ = ray.get(a.pull.remote(ok, host_name(cluster["node_b"], 8)), timeout=60)
    assert got and held                                                   # a live holder: fetched
    assert ray.get(b.leak_report.remote(), timeout=60)["leases"] == 0    # its export's lease back
    ray.kill(b)
    got, held, stats = ray.get(a.pull.remote(wire, host_name(cluster["node_b"], 8)), timeout=60)
    assert not got and not held and stats["fetch_failed_HolderLostError"] == 1
    got, held, stats = ray.get(a.pull.remote(wire, None), timeout=60)   # the registry may still list b
    assert not got and not held
    after = ray.get(a.leak_report.remote(), timeout=60)
    assert after["leases"] == 0 and after["used_pages"] == after["cached_pages"]
    assert after["cached_pages"] == before["cached_pages"] + 2            # the one fetched group only
    ray.kill(a)


def test_import_takes_pages_under_the_lock_and_gives_them_back_when_it_cannot_keep_them():
    """No Ray: an import fills its pages outside the cache's lock; a bad buffer takes nothing,
    and a key imported by another thread meanwhile gives the pages back (no leak either way)."""
    from mmtier.cache import GroupPages
    from mmtier.cluster.pool import PoolService
    from mmtier.errors import ShapeError

    cfg = MODEL.cache_config(device_bytes=6 << 20)
    src, dst = PoolService(cfg, name="src", node="n"), PoolService(cfg, name="dst", node="n")
    spec = cfg.spec("vision")
    key = src.cache.content_key("vision", _blob("race", 64), tenant="acme")
    k, v = _kv(spec, 2 * spec.page_size + 9)
    src.put(key.to_wire(), k, v)
    meta, buf = src.export(key.to_wire())
    pool = dst.cache.pools["vision"]
    free = pool.num_free
    with pytest.raises(ShapeError):
        dst.cache.import_pages(key, GroupPages.from_wire(meta, buf[:-1]))
    assert pool.num_free == free
    # another thread imports the same key while this one copies (a host pool copies with
    # np.copyto): its pages go back
    real_copy = np.copyto
    raced = []

    def copy_then_race(dst_arr, src_arr, *a, **kw):
        out = real_copy(dst_arr, src_arr, *a, **kw)
        if not raced:
            raced.append(True)
            assert dst.cache.import_pages(key, GroupPages.from_wire(meta, buf))   # the other import wins
        return out

    np.copyto = copy_then_race
    try:
        assert not dst.cache.import_pages(key, GroupPages.from_wire(meta, buf))
    finally:
        np.copyto = real_copy
    assert raced
    assert pool.num_free == free - 3 and dst.leak_report()["used_pages"] == dst.leak_report()["cached_pages"]
    got_k, got_v = dst.cache.read_group(key)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
