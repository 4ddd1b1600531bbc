"""The Ray layer on a real three-node cluster on loopback (one module-scoped cluster).

Nodes: head (one CPU pool), A (custom resource ``fake_gpu: 2`` standing in for two GPUs: two
pools), B (one CPU pool); a store on each. Faults are real: ``ray.kill`` of actors and
``cluster.remove_node``. The config has a disk tier (a temporary directory made by the
``cluster`` fixture): pools demote to disk under pressure, stores spill host -> disk.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

import mmtier.cluster as mma  # noqa: E402
from mmtier import CacheConfig, ForeignKeyError, ModalitySpec, PrefixMismatchError, UnknownKeyError  # noqa: E402
from mmtier.cluster import ClusterSettings, HolderLostError  # noqa: E402
from mmtier.cluster.registry_shards import shard_name  # noqa: E402
from tests.support.composed import check_facade  # noqa: E402
from tests.support.oracle import Logical as OracleLog  # noqa: E402
from tests.support.oracle import oracle_attention, rel_err  # noqa: E402
from tests.support.waits import wait_until  # noqa: E402

pytestmark = pytest.mark.ray

L, H, D = 2, 2, 16
HQ = 4
STORE = 100 << 20

CFG = CacheConfig(
    model="tiny-mm", num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32",
    modalities={"text": ModalitySpec(page_size=4), "vision": ModalitySpec(page_size=8),
                "vision_embed": ModalitySpec(kind="embedding", width=12, page_size=8)},
    device="cpu", device_bytes=2 << 20, key_secret="test-secret")
SETTINGS = ClusterSettings(device_resource="fake_gpu", sweep_interval_s=0.5, ping_timeout_s=1.0,
                           sweep_misses=2, call_timeout_s=20.0, copy_after_remote_uses=2,
                           store_bytes=128 << 10)     # a tiny store host tier: 32 vision pages


def _node_args(cpus: int, res: dict) -> dict:
    return {"num_cpus": cpus, "resources": res, "object_store_memory": STORE}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    global CFG
    CFG = CFG.model_copy(update={"disk_dir": tmp_path_factory.mktemp("mmtier-tiers")})
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"node_head": 1}, "object_store_memory": STORE,
        "include_dashboard": False})
    c.add_node(**_node_args(1, {"node_a": 1, "fake_gpu": 2}))
    c.add_node(**_node_args(1, {"node_b": 1}))
    c.wait_for_nodes()
    ray.init(address=c.address, namespace="mmtier", include_dashboard=False)
    try:
        yield c
    finally:
        mma.shutdown(SETTINGS)
        ray.shutdown()
        c.shutdown()


def node_of(resource: str) -> str:
    for n in ray.nodes():
        if n["Alive"] and resource in n["Resources"]:
            return n["NodeID"]
    raise LookupError(resource)


@pytest.fixture(scope="module")
def cc(cluster):
    report = mma.start(CFG, SETTINGS)
    assert len(report.created) == SETTINGS.registry_shards + 3 + 4
    client = mma.connect(SETTINGS)
    yield client
    client.close()


def kv(n):
    return torch.randn(L, n, H, D), torch.randn(L, n, H, D)


class Logical(OracleLog):
    """What a sequence holds, for the oracle, checked against a cluster cache."""

    def check(self, cc, seq, layer=1, n_q=3, groups=None, keys=None, causal=True, tol=2e-5):
        """``groups``: the tags the oracle keeps; ``keys``: the same groups for the cache."""
        k = torch.cat(self.k, 1)[layer]
        v = torch.cat(self.v, 1)[layer]
        pos = torch.arange(k.shape[0])
        if groups is not None:
            idx = torch.tensor([i for i, t in enumerate(self.tags) if t in groups])
            k, v, pos = k[idx], v[idx], pos[idx]
        q = torch.randn(n_q, HQ, D)
        total = len(self.tags)
        q_pos = torch.arange(total - n_q, total)
        out = cc.attention(seq, layer, q, groups=keys, causal=causal)
        ref, _ = oracle_attention(q, q_pos, k, v, pos, causal=causal)
        assert rel_err(out, ref) < tol
        return out


# ---------------------------------------------------------------------- start, names, pinning
def test_the_client_is_a_facade_over_parts_that_do_not_import_it():
    """``ClusterCache`` holds its parts, one file each (no cluster needed): no base classes, no
    part importing ``client``; every operation keeps its async and blocking twins."""
    from mmtier.cluster.client import ClusterCache
    from mmtier.cluster.client_attach import Attacher
    from mmtier.cluster.client_attention import ClusterAttention
    from mmtier.cluster.client_holders import Holders
    from mmtier.cluster.client_keys import ClusterKeys
    from mmtier.cluster.client_sequences import SequenceBook
    from mmtier.cluster.client_shared import SharedGroups
    from mmtier.cluster.transfer_copies import GroupCopier

    check_facade(ClusterCache, [Holders, ClusterKeys, SequenceBook, Attacher, SharedGroups, GroupCopier,
                                ClusterAttention], min_parts=7)
    for name in ("create_sequence", "append", "attach", "release", "contains", "contains_many",
                 "locate", "locate_many", "put", "put_embedding", "get_embedding", "offload",
                 "attention", "attention_state", "actor_stats", "stats", "leak_report",
                 "registry_stats"):
        sync, twin = getattr(ClusterCache, name), getattr(ClusterCache, name + "_async")
        assert sync.__doc__.endswith(f"Blocking twin of ``{name}_async``.") and callable(twin)
        assert sync.__qualname__ == f"ClusterCache.{name}"


def test_start_is_idempotent_and_pins_by_node(cc):
    again = mma.start(CFG, SETTINGS)
    assert again.created == [] and len(again.existing) == SETTINGS.registry_shards + 7
    a, b, head = node_of("node_a"), node_of("node_b"), node_of("node_head")
    assert cc.pools(a) == [f"mmtier-pool:{a}:dev0", f"mmtier-pool:{a}:dev1"]
    assert cc.pools(b) == [f"mmtier-pool:{b}:cpu0"] and cc.pools(head) == [f"mmtier-pool:{head}:cpu0"]
    for name in cc.pools() + cc.stores():
        h = ray.get_actor(name, namespace="mmtier")
        assert ray.get(h.ping.remote(), timeout=20)["node"] == name.split(":")[1]
    # a mismatching config is refused, not silently mixed
    with pytest.raises(ValueError):
        mma.start(CFG.model_copy(update={"key_secret": "other"}), SETTINGS)


# ---------------------------------------------------------------------- hits and keys everywhere
@ray.remote(num_cpus=0)
def _probe(media: bytes, settings_json: dict):
    import mmtier.cluster as m

    c = m.connect(ClusterSettings(**settings_json))
    key = c.content_key("vision", media, tenant="acme")
    found = c.contains(key)
    other = c.contains(c.content_key("vision", media, tenant="evil"))
    c.close()
    return key.to_wire(), found, other, ray.get_runtime_context().get_node_id()


def test_content_put_once_is_found_from_every_node(cc):
    media = b"image-cross-node"
    key = cc.content_key("vision", media, tenant="acme")
    assert cc.put(key, *kv(20), node=node_of("node_a")) is True
    assert cc.put(key, *kv(20)) is False                       # stored once, whoever asks
    for res in ("node_head", "node_a", "node_b"):
        wire, found, other, where = ray.get(_probe.options(resources={res: 0.01}).remote(
            media, SETTINGS.model_dump()), timeout=120)
        assert where == node_of(res)
        assert wire == key.to_wire() and found and not other


# ---------------------------------------------------------------------- attention for any placement
@pytest.mark.parametrize("transfer", ["local", "remote", "copy"])
def test_attention_equals_oracle_for_any_placement(cc, transfer):
    a, b = node_of("node_a"), node_of("node_b")
    img1 = cc.content_key("vision", f"img1-{transfer}".encode(), tenant="acme")
    img2 = cc.content_key("vision", f"img2-{transfer}".encode(), tenant="acme")
    k1, v1 = kv(19)
    k2, v2 = kv(9)
    home = a if transfer == "local" else b
    assert cc.put(img1, k1, v1, node=a)
    assert cc.put(img2, k2, v2, node=home)
    seq = cc.create_sequence("acme", node=home)
    log = Logical()
    t1 = kv(7)
    cc.append(seq, "text", *t1)
    log.add(*t1, "t1")
    cc.attach(seq, img1, transfer=None if transfer == "local" else transfer)
    log.add(k1, v1, "img1")
    t2 = kv(5)
    cc.append(seq, "text", *t2)
    log.add(*t2, "t2")
    cc.attach(seq, img2)
    log.add(k2, v2, "img2")
    t3 = kv(3)
    cc.append(seq, "text", *t3)
    log.add(*t3, "t3")
    before = cc.counters["remote_attentions"]
    log.check(cc, seq, layer=1, n_q=4)
    log.check(cc, seq, layer=0, n_q=1)
    log.check(cc, seq, layer=1, n_q=2, groups={"img1"}, keys=[img1], causal=False)
    out = cc.attention(seq, 1, torch.randn(2, HQ, D), groups=[img1], causal=False)
    assert out.shape == (2, HQ, D)
    remote = cc.counters["remote_attentions"] - before
    assert (remote > 0) == (transfer == "remote")
    loc = cc.locate(img1)
    holders = {h for h, _ in loc.holders}
    assert (f"mmtier-pool:{b}:cpu0" in holders) == (transfer == "copy")
    # the prefix chain does not depend on placement
    assert cc.prefix_key(seq) == _single_process_prefix(t1, k1, t2, k2, t3, img1, img2)
    view = cc.sequence(seq)
    assert view.length == len(log.tags) and view.home is not None and img1 in view.attached
    cc.release(seq)


def _single_process_prefix(t1, k1, t2, k2, t3, img1, img2):
    from mmtier import TieredKVCache

    c = TieredKVCache(CFG.model_copy(update={"disk_dir": None}))
    c.put(img1, k1, torch.zeros_like(k1))
    c.put(img2, k2, torch.zeros_like(k2))
    s = c.create_sequence("acme")
    c.append(s, "text", *t1)
    c.attach(s, img1)
    c.append(s, "text", *t2)
    c.attach(s, img2)
    c.append(s, "text", *t3)
    return c.prefix_key(s)


def test_copy_after_n_remote_uses(cc):
    a, b = node_of("node_a"), node_of("node_b")
    img = cc.content_key("vision", b"popular", tenant="acme")
    k, v = kv(16)
    cc.put(img, k, v, node=a)
    home = f"mmtier-pool:{b}:cpu0"
    seqs = []
    for i in range(2):                      # copy_after_remote_uses=2: remote, then copy
        s = cc.create_sequence("acme", node=b)
        cc.attach(s, img)
        seqs.append(s)
        holders = {h for h, _ in cc.locate(img).holders}
        assert (home in holders) == (i == 1)
        log = Logical()
        log.add(k, v, "img")
        log.check(cc, s, n_q=2)
    for s in seqs:
        cc.release(s)


def test_hint_keys_place_by_affinity_and_embeddings(cc):
    a = node_of("node_a")
    img = cc.content_key("vision", b"affinity", tenant="acme")
    cc.put(img, *kv(8), node=a)
    holder = next(h for h, _ in cc.locate(img).holders)
    seq = cc.create_sequence("acme", hint_keys=[img])
    assert cc.where(seq) == holder
    lazy = cc.create_sequence("acme")
    cc.attach(lazy, img)                    # placed at first attach: on the holder
    assert cc.where(lazy) == holder
    cc.release(seq)
    cc.release(lazy)
    e = cc.content_key("vision_embed", b"affinity", tenant="acme")
    x = torch.randn(10, 12)
    assert cc.put_embedding(e, x, node=node_of("node_b"))
    assert torch.equal(cc.get_embedding(e), x)


def test_tenant_separation_across_nodes(cc):
    a, b = node_of("node_a"), node_of("node_b")
    ka = cc.content_key("vision", b"secret-image", tenant="tenant-a")
    kb = cc.content_key("vision", b"secret-image", tenant="tenant-b")
    assert ka != kb
    cc.put(ka, *kv(8), node=a)
    assert cc.contains(ka) and not cc.contains(kb)
    seq = cc.create_sequence("tenant-b", node=b)
    with pytest.raises(ForeignKeyError):
        cc.attach(seq, ka)
    with pytest.raises(ForeignKeyError):
        cc.attach(seq, ka, transfer="copy")
    cc.release(seq)
    forged = type(ka)(ka.digest, ka.modality, ka.sharing, ka.scope, b"\0" * 32)
    with pytest.raises(ForeignKeyError):
        cc.contains(forged)


@pytest.mark.parametrize("transfer", ["remote", "copy"])
def test_a_prefix_dependent_group_attaches_only_under_its_prefix(cc, transfer):
    """The client checks a prefix-dependent key's place in the cluster sequence (the pools hold
    only parts of it): another prefix is ``PrefixMismatchError``, nothing changed; the same
    prefix attaches wherever the group lives; a content-only group attaches anywhere."""
    a, b = node_of("node_a"), node_of("node_b")
    prompt = kv(6)
    first = cc.create_sequence("acme", node=a)
    cc.append(first, "text", *prompt, tokens=list(range(6)))
    img = cc.content_key("vision", f"after-six-{transfer}".encode(), tenant="acme", parent=cc.prefix_key(first))
    assert cc.put(img, *kv(10), node=a)
    cc.attach(first, img)
    other = cc.create_sequence("acme", node=b)
    cc.append(other, "text", *kv(6), tokens=list(range(1, 7)))       # other tokens before it
    before = (cc.sequence(other).length, cc.prefix_key(other))
    with pytest.raises(PrefixMismatchError):
        cc.attach(other, img, transfer=transfer)
    assert (cc.sequence(other).length, cc.prefix_key(other)) == before
    same = cc.create_sequence("acme", node=b)
    cc.append(same, "text", *prompt, tokens=list(range(6)))
    cc.attach(same, img, transfer=transfer)                         # held on a, home on b
    assert cc.sequence(same).length == 16
    plain = cc.content_key("vision", f"anywhere-{transfer}".encode(), tenant="acme")
    assert cc.put(plain, *kv(10), node=a)
    cc.attach(other, plain, transfer=transfer)
    assert cc.sequence(other).length == 16
    for seq in (first, other, same):
        cc.release(seq)


def test_offload_to_node_store_serves_remote_and_copy(cc):
    a, b = node_of("node_a"), node_of("node_b")
    img = cc.content_key("vision", b"offloaded", tenant="acme")
    k, v = kv(13)
    cc.put(img, k, v, node=a)
    assert cc.offload(img)
    assert {h for h, _ in cc.locate(img).holders} == {f"mmtier-store:{a}"}
    s1 = cc.create_sequence("acme", node=b)
    t = kv(3)
    cc.append(s1, "text", *t)
    cc.attach(s1, img, transfer="remote")    # partial attention in the store, in place
    log = Logical()
    log.add(*t, "t")
    log.add(k, v, "img")
    log.check(cc, s1, n_q=2)
    s2 = cc.create_sequence("acme", node=b)
    cc.attach(s2, img, transfer="copy")      # restore into B's pool
    log2 = Logical()
    log2.add(k, v, "img")
    log2.check(cc, s2, n_q=2)
    cc.release(s1)
    cc.release(s2)


# ---------------------------------------------------------------------- faults
def _wait_until(pred, timeout=15.0) -> bool:
    return wait_until(pred, timeout)


def test_killed_pool_loses_only_its_own_and_nothing_hangs(cc):
    a, b, head = node_of("node_a"), node_of("node_b"), node_of("node_head")
    only = cc.content_key("vision", b"only-on-victim", tenant="acme")
    safe = cc.content_key("vision", b"on-head", tenant="acme")
    ko, vo = kv(10)
    ks, vs = kv(10)
    cc.put(only, ko, vo, node=a)
    (victim, _), = cc.locate(only).holders
    cc.put(safe, ks, vs, node=head)
    s_only = cc.create_sequence("acme", node=b)
    cc.attach(s_only, only, transfer="remote")
    s_safe = cc.create_sequence("acme", node=b)
    cc.attach(s_safe, safe, transfer="remote")
    s_home = cc.create_sequence("acme", node=a)
    cc.append(s_home, "text", *kv(4))
    if cc.where(s_home) != victim:
        cc.release(s_home)
        s_home = None
    ray.kill(ray.get_actor(victim, namespace="mmtier"))
    t0 = time.monotonic()
    assert _wait_until(lambda: not cc.contains(only)), "the dead pool's holdings stayed"
    assert time.monotonic() - t0 < 10
    assert cc.contains(safe)
    log = Logical()
    log.add(ks, vs, "safe")
    log.check(cc, s_safe, n_q=2)                 # unaffected
    t0 = time.monotonic()
    with pytest.raises(HolderLostError):
        cc.attention(s_only, 0, torch.randn(1, HQ, D))
    assert time.monotonic() - t0 < SETTINGS.call_timeout_s
    if s_home is not None:
        with pytest.raises(UnknownKeyError):
            cc.attention(s_home, 0, torch.randn(1, HQ, D))
    cc.release(s_only)
    # recompute: put again, lands on a live pool, serves
    assert cc.put(only, ko, vo, node=a)
    s = cc.create_sequence("acme", node=b)
    cc.attach(s, only, transfer="remote")
    log = Logical()
    log.add(ko, vo, "only")
    log.check(cc, s, n_q=1)
    cc.release(s)
    cc.release(s_safe)


def test_registry_restart_keeps_serving(cc):
    a = node_of("node_a")
    img = cc.content_key("vision", b"survives-registry", tenant="acme")
    k, v = kv(11)
    cc.put(img, k, v, node=a)
    for i in range(SETTINGS.registry_shards):              # every shard restarts
        ray.kill(ray.get_actor(shard_name(SETTINGS, i), namespace="mmtier"), no_restart=False)
    assert _wait_until(lambda: cc.contains(img), timeout=60)     # rebuilt from inventories
    seq = cc.create_sequence("acme", node=node_of("node_b"))
    cc.attach(seq, img)
    log = Logical()
    log.add(k, v, "img")
    log.check(cc, seq, n_q=2)
    cc.release(seq)
    new = cc.content_key("vision", b"after-restart", tenant="acme")
    assert cc.put(new, *kv(5)) and cc.contains(new)


def test_nodes_join_later_and_removed_node_leaves(cluster, cc):
    node = cluster.add_node(num_cpus=1, resources={"node_c": 1}, object_store_memory=STORE)
    cluster.wait_for_nodes()
    c = node_of("node_c")
    before = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    report = mma.start(CFG, SETTINGS)
    # the new node gets its store and pool; a pool killed earlier on a live node is recreated;
    # nothing that exists is touched
    assert {f"mmtier-store:{c}", f"mmtier-pool:{c}:cpu0"} <= set(report.created)
    assert not set(report.created) & before and set(report.existing) <= before
    cc.refresh()
    assert cc.pools(c) == [f"mmtier-pool:{c}:cpu0"]
    img = cc.content_key("vision", b"on-node-c", tenant="acme")
    k, v = kv(9)
    cc.put(img, k, v, node=c)
    seq = cc.create_sequence("acme", node=node_of("node_b"))
    cc.attach(seq, img, transfer="remote")
    log = Logical()
    log.add(k, v, "img")
    log.check(cc, seq, n_q=1)
    cluster.remove_node(node)
    t0 = time.monotonic()
    assert _wait_until(lambda: not cc.contains(img), timeout=60), "removed node's holdings stayed"
    elapsed = time.monotonic() - t0
    t0 = time.monotonic()
    with pytest.raises(UnknownKeyError):
        cc.attention(seq, 0, torch.randn(1, HQ, D))
    assert time.monotonic() - t0 < 2 * SETTINGS.call_timeout_s
    cc.release(seq)
    assert elapsed < 60


def test_no_pages_leak_once_every_sequence_is_released(cc):
    b = node_of("node_b")
    img = cc.content_key("vision", b"leak-check", tenant="acme")
    cc.put(img, *kv(12), node=node_of("node_a"))
    seqs = []
    for mode in ("remote", "copy", None):
        s = cc.create_sequence("acme", node=b)
        cc.append(s, "text", *kv(6))
        cc.attach(s, img, transfer=mode)
        cc.append(s, "text", *kv(2))
        seqs.append(s)
    for s in seqs:
        cc.release(s)
    reports = cc.leak_report()
    assert len(reports) >= 7
    for name, r in reports.items():
        assert r["sequences"] == 0 and r["handles"] == 0, name
        assert r["used_pages"] == r["cached_pages"], name
    assert all(r["leases"] == 0 for r in reports.values() if "leases" in r)   # exports gave them back
    assert any("leases" in r for r in reports.values())
    st = cc.stats()
    assert st.sequences == 0 and st.total_bytes("device") > 0


# ---------------------------------------------------------------------- the tier cascade
def _exported(key, k, v):
    """A group as a pool exports it: ``(meta, page-major uint8 buffer)``."""
    from mmtier import TieredKVCache

    with TieredKVCache(CFG.model_copy(update={"disk_dir": None})) as c:
        c.put(key, k, v)
        return c.export_pages(key).to_wire()


def _store_check(store, parts, layer=1, n_q=2, tol=2e-5):
    """``parts``: ``[(key, k, v)]`` laid out back to back from position 0; the store's partial
    attention over them equals the oracle."""
    wires, ks, vs, start = [], [], [], 0
    for key, k, v in parts:
        wires.append((key.to_wire(), start))
        ks.append(k[layer])
        vs.append(v[layer])
        start += k.shape[1]
    q = torch.randn(n_q, HQ, D)
    q_pos = torch.arange(start - n_q, start)
    out, _ = store.attend(wires, layer, q, q_pos)
    ref, _ = oracle_attention(q, q_pos, torch.cat(ks), torch.cat(vs), torch.arange(start))
    assert rel_err(out, ref) < tol


def test_store_spills_host_to_disk_serves_and_adopts_after_restart(tmp_path):
    """The NodeStoreService alone (no Ray): host LRU spills whole groups to disk, attention and
    export stream them back exactly, a recreated store adopts its directory, a corrupt file is a
    miss reported as lost, and the disk budget's bottom drops (reported as evicted)."""
    from mmtier import CorruptDataError, TieredKVCache
    from mmtier.cluster.store import NodeStoreService, store_dir

    cfg = CFG.model_copy(update={"disk_dir": tmp_path})
    maker = TieredKVCache(CFG.model_copy(update={"disk_dir": None}))
    page = cfg.spec("vision").page_bytes
    store = NodeStoreService(cfg, name="s", node="n1", capacity_bytes=5 * page)
    lost: list[str] = []
    store.on_lost = lost.extend
    groups = []
    for i in range(4):                                   # 2 pages each: the host holds 2
        key = maker.content_key("vision", f"spill-{i}".encode(), tenant="acme")
        k, v = kv(16)
        meta, buf = _exported(key, k, v)
        item, evicted = store.import_group(key.to_wire(), meta, buf)
        assert item is not None and item["tier"] == "host" and evicted == []
        groups.append((key, k, v, buf))
    tiers = {it["key"]["digest"]: it["tier"] for it in store.inventory()}
    assert [tiers[g[0].hex] for g in groups] == ["disk", "disk", "host", "host"]
    assert store.counters["spills"] == 2 and store.counters["evictions"] == 0
    assert store.holds([g[0].to_wire() for g in groups]) == [True] * 4
    _store_check(store, [groups[0][:3]])                           # disk, streamed
    _store_check(store, [groups[1][:3], groups[3][:3]], n_q=5)     # disk + host, merged
    meta, buf = store.export(groups[0][0].to_wire())
    assert meta["num_tokens"] == 16 and (buf == groups[0][3]).all()
    assert meta["xxh3"] == _exported(groups[0][0], *groups[0][1:3])[0]["xxh3"]   # the checksums travel
    big = maker.content_key("vision", b"too-big-for-host", tenant="acme")
    kb, vb = kv(48)                                      # 6 pages > the host budget: to disk
    item, evicted = store.import_group(big.to_wire(), *_exported(big, kb, vb))
    assert item["tier"] == "disk" and evicted == []
    store.close()

    again = NodeStoreService(cfg, name="s", node="n1", capacity_bytes=5 * page)  # warm restart
    again.on_lost = lost.extend
    tiers = {it["key"]["digest"]: it["tier"] for it in again.inventory()}
    # the spilled groups, the big one, and the host ones the write-behind wrote
    assert tiers == {**{g[0].hex: "disk" for g in groups}, big.hex: "disk"}
    assert again.counters["adopted_from_disk"] == 5
    _store_check(again, [(big, kb, vb)], n_q=3)
    victim = next(store_dir(cfg, "n1").glob(f"vision-{groups[1][0].hex}-*.arrow"))
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    with pytest.raises(CorruptDataError):
        again.export(groups[1][0].to_wire())
    assert lost == [groups[1][0].address] and again.holds([groups[1][0].to_wire()]) == [False]
    again.close()

    small = cfg.model_copy(update={"disk_bytes": 3 * (2 * page + 4096)})   # 3 groups on disk
    bottom = NodeStoreService(small, name="b", node="n2", capacity_bytes=2 * page)
    keys, dropped = [], []
    for i in range(6):
        key = maker.content_key("vision", f"bottom-{i}".encode(), tenant="acme")
        _item, evicted = bottom.import_group(key.to_wire(), *_exported(key, *kv(16)))
        keys.append(key)
        dropped += evicted
    assert dropped == [keys[0].address, keys[1].address]         # the oldest leave at the bottom only
    assert bottom.holds([k.to_wire() for k in keys]) == [False, False] + [True] * 4
    bottom.close()
    maker.close()


def _actor(name):
    return ray.get_actor(name, namespace="mmtier")


def _tiers(name) -> dict[str, str]:
    """digest -> tier, from a holder actor's inventory."""
    return {it["key"]["digest"]: it["tier"] for it in ray.get(_actor(name).inventory.remote(), timeout=20)}


def test_pool_under_pressure_keeps_group_on_disk(cc):
    a, b = node_of("node_a"), node_of("node_b")
    pool = f"mmtier-pool:{b}:cpu0"
    x = cc.content_key("vision", b"pressured", tenant="acme")
    k, v = kv(40)
    assert cc.put(x, k, v, node=b)
    assert _tiers(pool)[x.hex] == "device"
    for i in range(30):                   # 20-page fillers through a 170-page vision pool
        cc.put(cc.content_key("vision", f"filler-{i}".encode(), tenant="acme"), *kv(160), node=b)
        if _tiers(pool)[x.hex] == "disk":
            break
    assert _tiers(pool)[x.hex] == "disk"
    assert {h for h, _ in cc.locate(x).holders} == {pool}       # still held, by the pool
    counters = ray.get(_actor(pool).stats.remote(), timeout=20)["counters"]
    assert counters["spills_to_disk"] >= 1 and counters.get("evictions", 0) == 0
    s1 = cc.create_sequence("acme", node=a)
    cc.attach(s1, x, transfer="copy")     # exported from b's disk into a pool on A
    log = Logical()
    log.add(k, v, "x")
    log.check(cc, s1, n_q=2)
    s2 = cc.create_sequence("acme", node=b)
    t = kv(3)
    cc.append(s2, "text", *t)
    cc.attach(s2, x)                      # local: served from the disk tier (or promoted)
    log = Logical()
    log.add(*t, "t")
    log.add(k, v, "x")
    log.check(cc, s2, n_q=2)
    cc.release(s1)
    cc.release(s2)


def test_store_spills_to_disk_and_serves_back(cc):
    a, b = node_of("node_a"), node_of("node_b")
    store = f"mmtier-store:{a}"
    groups = []
    for i in range(3):                    # 20 pages each; the store's host holds 32
        key = cc.content_key("vision", f"offload-spill-{i}".encode(), tenant="acme")
        k, v = kv(160)
        cc.put(key, k, v, node=a)
        assert cc.offload(key)
        groups.append((key, k, v))
    tiers = _tiers(store)
    assert [tiers.get(g[0].hex) for g in groups] == ["disk", "disk", "host"]
    for key, _, _ in groups:
        assert {h for h, _ in cc.locate(key).holders} == {store}
    s1 = cc.create_sequence("acme", node=b)
    t = kv(3)
    cc.append(s1, "text", *t)
    cc.attach(s1, groups[0][0], transfer="remote")     # partial attention in the store, from disk
    log = Logical()
    log.add(*t, "t")
    log.add(*groups[0][1:], "g0")
    log.check(cc, s1, n_q=2)
    s2 = cc.create_sequence("acme", node=b)
    cc.attach(s2, groups[1][0], transfer="copy")       # exported from the store's disk
    log = Logical()
    log.add(*groups[1][1:], "g1")
    log.check(cc, s2, n_q=2)
    cc.release(s1)
    cc.release(s2)


def test_recreated_store_adopts_and_announces_its_disk_groups(cc):
    a, b = node_of("node_a"), node_of("node_b")
    store = f"mmtier-store:{b}"
    groups = []
    for i in range(2):                    # the first spills to disk, the second stays in host
        key = cc.content_key("vision", f"survivor-{i}".encode(), tenant="acme")
        k, v = kv(160)
        cc.put(key, k, v, node=b)
        assert cc.offload(key)
        groups.append((key, k, v))
    (disk_key, k, v), (host_key, _, _) = groups
    tiers = _tiers(store)
    assert tiers[disk_key.hex] == "disk" and tiers[host_key.hex] == "host"
    # the write-behind puts the host group on disk too (a wait, bounded, not a timing)
    assert _wait_until(lambda: ray.get(_actor(store).stats.remote(), timeout=20)["durable_queued"] == 0)
    ray.kill(_actor(store), no_restart=True)
    assert _wait_until(lambda: not cc.contains(disk_key) and not cc.contains(host_key))
    report = mma.start(CFG, SETTINGS)
    assert store in report.created
    fresh = mma.connect(SETTINGS)
    try:
        assert _wait_until(lambda: fresh.contains(disk_key))
        assert {h for h, _ in fresh.locate(disk_key).holders} == {store}
        assert fresh.contains(host_key)                    # its host group came back from disk
        assert _tiers(store) == {disk_key.hex: "disk", host_key.hex: "disk"}
        # the old client still holds the dead store's handle: its first call fails typed, it
        # takes the recreated actor's handle, and the new actor's holdings stay registered
        old_seq = cc.create_sequence("acme", node=a)
        for _ in range(2):
            try:
                cc.attach(old_seq, disk_key, transfer="remote")
                break
            except HolderLostError:
                pass
        assert cc.holders.actors[store]._actor_id == _actor(store)._actor_id
        assert fresh.contains(disk_key)
        cc.release(old_seq)
        seq = fresh.create_sequence("acme", node=a)
        fresh.attach(seq, disk_key, transfer="remote")
        log = Logical()
        log.add(k, v, "g")
        log.check(fresh, seq, n_q=2)
        fresh.release(seq)
    finally:
        fresh.close()


def test_recreated_pool_adopts_and_announces_its_disk_groups(cc):
    a, b = node_of("node_a"), node_of("node_b")
    pool = f"mmtier-pool:{b}:cpu0"
    x = cc.content_key("vision", b"pool-survivor", tenant="acme")
    k, v = kv(40)
    assert cc.put(x, k, v, node=b)
    for i in range(30):                   # push it to the pool's disk tier
        cc.put(cc.content_key("vision", f"push-{i}".encode(), tenant="acme"), *kv(160), node=b)
        if _tiers(pool)[x.hex] == "disk":
            break
    on_disk = {d for d, t in _tiers(pool).items() if t == "disk"}
    assert x.hex in on_disk
    ray.kill(_actor(pool), no_restart=True)
    assert _wait_until(lambda: not cc.contains(x))
    assert pool in mma.start(CFG, SETTINGS).created
    fresh = mma.connect(SETTINGS)
    try:
        assert _wait_until(lambda: fresh.contains(x))
        # what was on its disk comes back; of its device content, what the write-behind wrote
        adopted = _tiers(pool)
        assert on_disk <= set(adopted) and set(adopted.values()) == {"disk"}
        seq = fresh.create_sequence("acme", node=a)
        fresh.attach(seq, x, transfer="remote")                    # a proxy in the new pool
        log = Logical()
        log.add(k, v, "x")
        log.check(fresh, seq, n_q=2)
        fresh.release(seq)
    finally:
        fresh.close()
